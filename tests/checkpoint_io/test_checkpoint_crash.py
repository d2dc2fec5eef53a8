"""A process killed (SIGKILL) in the middle of a save leaves `latest` naming a
complete checkpoint, equal to what was saved at that step.

A child trains a deterministic model and saves after every step, into one
directory shared by every round (so rounds also overwrite each other's tags
and find each other's leftovers). The kill is timed by events, not delays:
the child announces each save it starts (a shared counter); the parent picks
a save and a point in it (the save's temporary directory appearing, one of
its files appearing, its manifest written: Note [checkpoint layout]), polls
the directory for it and kills at once, so each round lands at a different
moment of a save however fast or loaded the machine is. The parent then
loads through `latest` and compares with its own run of the same steps.
Children fork from a forkserver that has torch imported already, so a round
costs a few steps and saves, not an interpreter start.
"""
import random
import time
from pathlib import Path

import pytest

import torch
from torch import nn

import offload
from tests.checkpoint_io.checkpoint_runs import fresh_process_context

ROUNDS = 6
# Where in save k the kill lands: once this exists in the save's temporary
# directory (the directory itself for ""), or the save has moved past it.
POINTS = ("", "rank0/engine_state.json", "rank0/state.safetensors", "manifest.json")
TIMEOUT_S = 120


def _model():
    torch.manual_seed(0)
    # ~100k parameters: a save (about 1.6 MB in 10 files) takes far longer than a step.
    return nn.Sequential(nn.Linear(96, 320), nn.Tanh(), nn.Linear(320, 192), nn.Tanh(), nn.Linear(192, 7))


def _config(swap):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(swap)},
                              "offload_optimizer": {"device": "cpu"}},
    }


def _step(engine, k):
    gen = torch.Generator().manual_seed(k)
    x, y = torch.randn(4, 96, generator=gen), torch.randn(4, 7, generator=gen)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def _saver(root, round_, ready, saving):
    torch.set_num_threads(1)
    with offload.initialize(_model(), _config(f"{root}/swap{round_}")) as engine:
        ready.set()
        for k in range(1, 10_000):
            _step(engine, k)
            saving.value = k  # the parent times its kill from here
            engine.save_checkpoint(f"{root}/ck", client_state={"step": k})


def _wait(condition, child, what):
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if not child.is_alive():
            pytest.fail(f"the saver exited ({child.exitcode}) before {what}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"no sign in {TIMEOUT_S} s that {what}")
        time.sleep(0.001)


def _kill_inside_save(child, saving, ck: Path, k: int, point: str) -> None:
    """Kills `child` once its save of step k has reached `point` (or gone past it)."""
    _wait(lambda: saving.value >= k, child, f"save {k} started")
    tmp = ck / f".global_step{k}.tmp"  # this save's own (stale ones are never picked)
    seen = []

    def reached():
        if tmp.exists():
            seen.append(True)
        return saving.value > k or (tmp / point).exists() or (seen and not tmp.exists())

    _wait(reached, child, f"save {k} reached {point or 'its directory'}")
    child.kill()


def _leftovers(ck):
    """Temporary and old directories of interrupted saves, with their modification times."""
    if not ck.exists():
        return {}
    return {p.name: p.stat().st_mtime_ns for p in ck.iterdir() if p.name.startswith(".")}


class _Reference:
    """The same training in this process; masters after each step, computed as needed."""

    def __init__(self, root):
        self.engine = offload.initialize(_model(), _config(root / "swap_ref"))
        self.masters = {0: self.engine.full_state_dict(master=True)}

    def at(self, k):
        while len(self.masters) <= k:
            _step(self.engine, len(self.masters))
            self.masters[len(self.masters)] = self.engine.full_state_dict(master=True)
        return self.masters[k]


def test_sigkill_during_saves_leaves_latest_loadable_and_exact(tmp_path):
    ctx = fresh_process_context()
    rng = random.Random(20261122)
    reference = _Reference(tmp_path)
    interrupted, loaded_steps, before = 0, [], {}
    try:
        for round_ in range(ROUNDS):
            ready, saving = ctx.Event(), ctx.Value("i", 0, lock=False)  # a kill never leaves it locked
            # One of the first three saves whose temporary directory no earlier kill
            # left (its files there could be taken for this save's; each round leaves
            # at most one, so ROUNDS candidates never run out).
            k = rng.choice([k for k in range(1, ROUNDS + 1) if f".global_step{k}.tmp" not in before][:3])
            child = ctx.Process(target=_saver, args=(str(tmp_path), round_, ready, saving))
            child.start()
            assert ready.wait(timeout=TIMEOUT_S), "saver process did not start"
            _kill_inside_save(child, saving, tmp_path / "ck", k, POINTS[round_ % len(POINTS)])
            child.join()
            now = _leftovers(tmp_path / "ck")
            interrupted += any(before.get(name) != stamp for name, stamp in now.items())
            before = now
            if not (tmp_path / "ck" / "latest").exists():  # killed before any save completed
                assert not [p for p in (tmp_path / "ck").glob("global_step*")], "committed without latest"
                continue
            with offload.initialize(_model(), _config(tmp_path / f"swap_load{round_}")) as engine:
                step = engine.load_checkpoint(tmp_path / "ck")[1]["step"]
                assert engine.global_steps == step
                for name, value in reference.at(step).items():
                    assert torch.equal(engine.full_state_dict(master=True)[name], value), (round_, step, name)
            loaded_steps.append(step)
    finally:
        reference.engine.close()
    # The kills hit saves in progress (each leaves a temporary directory changed),
    # not the gaps between saves: all six do here, half is the floor on a loaded machine.
    assert interrupted >= ROUNDS // 2, f"only {interrupted} of {ROUNDS} kills interrupted a save ({loaded_steps})"
