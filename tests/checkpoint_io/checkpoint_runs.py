"""Training runs for the checkpoint tests, importable by spawned processes.

A run draws its batches (and their sequence length) from the global torch and
python RNGs, so a resumed run only matches the straight one if the RNG
states were saved and restored along with the weights, optimizer state,
counters and LR schedule.
"""
import os
import random
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload
from offload.checkpoint_io.load import read_swap_file
from offload.tiers import Tier
from tests.support.harness import build, lm_loss, make_config, on_test_device
from tests.support.models import VOCAB

WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                         "warmup_num_steps": 5}}
GAS = 2
MICRO_STEPS = 12  # 6 optimizer steps; the checkpoint is taken after 3
PROBE_INPUT = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
CASES_W2 = [  # every tier between them: none, cpu, nvme
    ("tiny_gpt", "nvme", "nvme", "fp32"),
    ("shared_param", "none", "cpu", "fp32"),
]
_WORLD2 = {}


def case_config(case, root, rank_tag=""):
    model, param, optim, precision = case
    return make_config(param, optim, os.path.join(root, f"swap{rank_tag}"), gas=GAS,
                       precision=precision, scheduler=WARMUP)


def seed(rank, salt=0):
    random.seed(1000 * salt + rank)
    torch.manual_seed(2000 * salt + rank)


def train(engine, micro_steps):
    losses = []
    for _ in range(micro_steps):
        seq = random.randint(2, 9)
        x, y = on_test_device(torch.randint(0, VOCAB, (3, seq)), torch.randint(0, VOCAB, (3, seq)))
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return torch.stack(losses).cpu()


def snapshot(engine):
    """Full fp32 masters and compute-dtype copies (a collective with several ranks)."""
    return {kind: {name: t.cpu() for name, t in engine.full_state_dict(master=master).items()}
            for kind, master in (("master", True), ("home", False))}


def straight_and_first_half(case, root, rank=0):
    """6 optimizer steps straight, then (fresh engine) 3 steps and a save; returns the straight result."""
    model_a, model_b = build(case[0]), build(case[0])  # build() seeds: before seed(rank)
    seed(rank)
    with offload.initialize(model_a, case_config(case, os.path.join(root, "a"), str(rank))) as e:
        losses = train(e, MICRO_STEPS)
        straight = snapshot(e) | {"losses": losses}
    seed(rank)
    with offload.initialize(model_b, case_config(case, os.path.join(root, "b"), str(rank))) as e:
        train(e, MICRO_STEPS // 2)
        with torch.no_grad():  # for tests/checkpoint_io/test_consolidate.py: the engine's output at the save
            straight["output_at_save"] = e(*on_test_device(PROBE_INPUT)).float().cpu()
        straight["at_save"] = snapshot(e)
        # Another tag beside it, saved asynchronously: the next save commits it (with
        # several ranks, after all of them report their files).
        e.save_checkpoint(os.path.join(root, "ckpt"), tag="at-half", async_save=True)
        e.save_checkpoint(os.path.join(root, "ckpt"), client_state={"half": MICRO_STEPS // 2})
    return straight


def second_half(case, root, rank=0):
    """A fresh engine from a different init and RNG state: load (via latest), 3 more steps."""
    model = build(case[0], seed=11)
    seed(rank, salt=7)
    with offload.initialize(model, case_config(case, os.path.join(root, "c"), str(rank))) as e:
        _, client = e.load_checkpoint(os.path.join(root, "ckpt"))
        counters = (e.global_steps, e.micro_steps, e.skipped_steps)
        losses = train(e, MICRO_STEPS // 2)
        return snapshot(e) | {"losses": losses, "client": client, "counters": counters}


def resume_all(cases, root, out_path, layer="cpu"):
    """Child process entry: the second halves of every case, results to out_path; on
    `layer` (a forkserver's children have the server's environment, not the test's)."""
    os.environ["OFFLOAD_DEVICE"] = layer
    torch.set_num_threads(1)
    try:
        results = {i: second_half(case, os.path.join(root, f"case{i}")) for i, case in enumerate(cases)}
    except BaseException:  # the parent reports it: a child's stderr is not the test's
        import traceback

        with open(out_path + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise
    torch.save(results, out_path)


def fresh_process_context(layer: str = "cpu"):
    """New processes forked from a server that has imported torch (and torch._dynamo, which
    torch.optim imports on first use: seconds) and nothing else: no engine, no RNG use.
    On cuda, spawned: a server whose imports touched CUDA (the stream sanitizer does at
    the first tensor op) cannot fork a child that uses it."""
    if layer == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "offload.engine", "tests.checkpoint_io.checkpoint_runs"])
    return ctx


# ---- world size 2 -------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank, world, port, fn_name, cases, root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn = globals()[fn_name]
        out = {i: fn(case, os.path.join(root, f"case{i}"), rank) for i, case in enumerate(cases)}
        if rank == 0:
            torch.save(out, os.path.join(root, f"{fn_name}.pt"))
        results.put((rank, "ok"))
    except Exception:  # noqa: BLE001 - reported to the parent test
        results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_world(fn_name, cases, root, world=2, timeout=240):
    """Runs fn(case, case_root, rank) on `world` fresh gloo processes; rank 0's results."""
    ctx = fresh_process_context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dist_worker, args=(r, world, port, fn_name, cases, str(root), results))
             for r in range(world)]
    for p in procs:
        p.start()
    outcome = {}
    for _ in range(world):
        rank, status = results.get(timeout=timeout)
        outcome[rank] = status
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    failures = {r: s for r, s in outcome.items() if s != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{s}" for r, s in failures.items())
    # Every rank also exits cleanly (a SIGABRT at interpreter exit after good results: issue 16).
    assert [p.exitcode for p in procs] == [0] * world, f"worker exit codes {[p.exitcode for p in procs]}"
    return torch.load(os.path.join(root, f"{fn_name}.pt"), weights_only=False)


def world2_checkpoints(tmp_path_factory):
    """Straight runs and half-way checkpoints of CASES_W2 at world size 2 (made once per session)."""
    if "run" not in _WORLD2:
        root = tmp_path_factory.mktemp("world2")
        _WORLD2["run"] = (CASES_W2, root, run_world("straight_and_first_half", CASES_W2, root))
    return _WORLD2["run"]


def engine_state(engine):
    """Everything a failed load must leave alone, as plain values."""
    opt = engine.optimizer
    moments = {}
    for s in engine.shards:
        if Tier.NVME in opt.states.state_tiers:
            own_master = 0 if opt.states.shares_master(s) else 1  # Note [shared fp32 master]
            packed = read_swap_file(opt.states.state_file(s), torch.float32, (2 + own_master) * s.part_numel)
            moments[s.name] = packed[own_master * s.part_numel:].clone()
        else:
            moments[s.name] = torch.cat([t.cpu() for t in opt.state_tensors(s)[1:]])
    return {"weights": snapshot(engine), "moments": moments, "steps": dict(opt.shard_steps),
            "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
            "lr": [g["lr"] for g in opt.param_groups],
            "sched": engine.lr_scheduler.state_dict()["last_epoch"],
            "rng": (torch.get_rng_state(), random.getstate())}


def assert_same_state(a, b):
    for kind in ("master", "home"):
        for name in a["weights"][kind]:
            assert torch.equal(a["weights"][kind][name], b["weights"][kind][name]), name
    for name in a["moments"]:
        assert torch.equal(a["moments"][name], b["moments"][name]), name
    keys = ("steps", "counters", "lr", "sched")
    assert [a[k] for k in keys] == [b[k] for k in keys]
    assert torch.equal(a["rng"][0], b["rng"][0]) and a["rng"][1] == b["rng"][1]
