"""Checkpoints: exact resume in a new process (world size 1 and 2, every tier),
async saves that stay consistent while training goes on, and refusal of
incomplete, corrupt or mismatched checkpoints before anything changes."""
import json
import os
import shutil
import time

import pytest
import torch
from safetensors import safe_open

import offload
from offload.checkpoint_io import CheckpointError, files
from tests.checkpoint_io import checkpoint_runs as runs
from tests.support.harness import build, make_config
from tests.support.models import TinyGPT

CASES_W1 = [
    # model, offload_param, offload_optimizer, precision
    ("tiny_gpt", "cpu", "cpu", "fp32"),        # the fp32 host home is the master itself
    ("tiny_gpt", "nvme", "nvme", "fp32"),
    ("with_unused", "none", "none", "fp32"),   # frozen and unused parameters, a buffer
    ("shared_param", "cpu", "nvme", "bf16"),   # tied weights, mixed precision
]


def _assert_resumed_equals_straight(straight, resumed, case):
    for kind in ("master", "home"):
        for name, value in straight[kind].items():
            assert torch.equal(resumed[kind][name], value), f"{case} {kind} {name} differs after resume"
    # The resumed run's own losses (its data came from the restored RNG states).
    assert torch.equal(resumed["losses"], straight["losses"][runs.MICRO_STEPS // 2:]), case
    assert resumed["client"] == {"half": runs.MICRO_STEPS // 2}
    assert resumed["counters"] == (3, 6, 0)


@pytest.mark.slow
@pytest.mark.any_device
def test_resume_in_a_new_process_is_bitwise_exact(tmp_path):
    straight = {i: runs.straight_and_first_half(case, str(tmp_path / f"case{i}"))
                for i, case in enumerate(CASES_W1)}
    ctx = runs.fresh_process_context(os.environ["OFFLOAD_DEVICE"])
    out = tmp_path / "resumed.pt"
    child = ctx.Process(target=runs.resume_all, args=(CASES_W1, str(tmp_path), str(out), os.environ["OFFLOAD_DEVICE"]))
    child.start()
    child.join(timeout=240)
    error = out.with_name(out.name + ".error")
    assert child.exitcode == 0, (f"resuming process failed (exit code {child.exitcode})"
                                 + (f":\n{error.read_text()}" if error.exists() else ""))
    resumed = torch.load(out, weights_only=False)
    for i, case in enumerate(CASES_W1):
        _assert_resumed_equals_straight(straight[i], resumed[i], case)


@pytest.mark.slow
def test_resume_world_size_two_is_bitwise_exact(tmp_path_factory):
    cases, root, straight = runs.world2_checkpoints(tmp_path_factory)
    resumed = runs.run_world("second_half", cases, root)  # new processes
    for i, case in enumerate(cases):
        _assert_resumed_equals_straight(straight[i], resumed[i], case)
    # The same checkpoint into one rank: re-partitioned (tests/checkpoint_io/test_resume_world_size.py).


# ---- async saves --------------------------------------------------------------
def _engine(tmp_path, param="cpu", optim="nvme", model="tiny_gpt", seed=0, **kw):
    return offload.initialize(build(model, seed), make_config(param, optim, tmp_path / f"swap{seed}{param}",
                                                              scheduler=runs.WARMUP, **kw))


class _SlowWrites:
    """Slows the writer thread down (a sleep per file copy and per tensor), counting items."""

    def __init__(self, monkeypatch, delay=0.02):
        self.items = 0
        copy, write = files.copy_file, files.SafetensorsStream.write

        def slow_copy(*args):
            self.items += 1
            time.sleep(delay)
            return copy(*args)

        def slow_write(stream, *args):
            self.items += 1
            time.sleep(delay)
            return write(stream, *args)

        monkeypatch.setattr(files, "copy_file", slow_copy)
        monkeypatch.setattr(files.SafetensorsStream, "write", slow_write)


@pytest.mark.parametrize("param,optim", [("cpu", "nvme"), ("nvme", "cpu"), ("none", "none")])
@pytest.mark.slow
def test_async_save_snapshot_is_unchanged_by_steps_run_while_it_is_written(tmp_path, monkeypatch,
                                                                           param, optim):
    slow = _SlowWrites(monkeypatch)
    with _engine(tmp_path, param, optim) as e:
        runs.seed(0)
        runs.train(e, 3)
        at_save = runs.engine_state(e)
        e.save_checkpoint(tmp_path / "ck", client_state={"at": 3}, async_save=True)
        job = e.checkpoints.job
        assert job is not None and not job._snapshot_done.is_set(), "save did not return before writing"
        assert not (tmp_path / "ck" / "latest").exists()
        runs.train(e, 4)  # forward/backward overlap the write; each update waits for the snapshot
        assert e.global_steps == 7
        after = runs.engine_state(e)
        e.wait_checkpoint()
    assert slow.items > 10
    assert (tmp_path / "ck" / "latest").read_text().strip() == "global_step3"
    with _engine(tmp_path, param, optim, seed=5) as fresh:
        assert fresh.load_checkpoint(tmp_path / "ck") == (str(tmp_path / "ck" / "global_step3"), {"at": 3})
        loaded = runs.engine_state(fresh)
    loaded["rng"] = at_save["rng"]  # compared separately: RNG moved on in this process
    runs.assert_same_state(at_save, loaded)
    # ...while the steps run during the write did change the weights.
    assert not torch.equal(after["weights"]["master"]["wte.weight"],
                           at_save["weights"]["master"]["wte.weight"])


@pytest.mark.slow
def test_close_waits_for_an_async_save(tmp_path, monkeypatch):
    _SlowWrites(monkeypatch)
    e = _engine(tmp_path, "nvme", "nvme")
    runs.train(e, 1)
    e.save_checkpoint(tmp_path / "ck", async_save=True)
    e.close()  # removes the swap files the writer copies: only after it finished
    with _engine(tmp_path, "nvme", "nvme", seed=3) as fresh:
        fresh.load_checkpoint(tmp_path / "ck")
        assert fresh.global_steps == 1


def test_failed_async_save_is_reported_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    with _engine(tmp_path) as e:
        runs.train(e, 1)
        e.save_checkpoint(tmp_path / "ck")

        def disk_full(*a):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(files, "copy_file", disk_full)
        runs.train(e, 1)
        e.save_checkpoint(tmp_path / "ck", async_save=True)
        with pytest.raises(OSError, match="No space left"):
            e.wait_checkpoint()
        e.wait_checkpoint()  # reported once
    assert (tmp_path / "ck" / "latest").read_text().strip() == "global_step1"
    assert sorted(os.listdir(tmp_path / "ck")) == ["global_step1", "latest"]


# ---- layout and refusals --------------------------------------------------------
def test_layout_manifest_and_atomic_names(tmp_path):
    with _engine(tmp_path, "nvme", "cpu", model="with_unused") as e:
        runs.train(e, 2)
        tag = e.save_checkpoint(tmp_path / "ck")
        e.save_checkpoint(tmp_path / "ck", tag=tag)  # re-saving a tag replaces it
    root = tmp_path / "ck"
    assert sorted(os.listdir(root)) == [tag, "latest"]  # no temporary or old directory left
    manifest = json.loads((root / tag / "manifest.json").read_text())
    on_disk = {str(p.relative_to(root / tag)) for p in (root / tag).rglob("*") if p.is_file()}
    assert on_disk - {"manifest.json"} == set(manifest["files"])
    for rel, entry in manifest["files"].items():
        assert os.path.getsize(root / tag / rel) == entry["bytes"]
    with safe_open(str(root / tag / "rank0" / "state.safetensors"), framework="pt") as f:
        assert "buffer.bias_buf" in f.keys() and "exp_avg.0" in f.keys()


def test_interrupted_overwrite_of_a_tag_falls_back_to_the_old_copy(tmp_path):
    with _engine(tmp_path) as e:
        runs.train(e, 1)
        e.save_checkpoint(tmp_path / "ck", tag="t", client_state="one")
    # As if killed between moving `t` aside and renaming the new one in.
    os.rename(tmp_path / "ck" / "t", tmp_path / "ck" / ".t.old")
    with _engine(tmp_path, seed=2) as fresh:
        assert fresh.load_checkpoint(tmp_path / "ck")[1] == "one"


def test_save_between_backward_and_step_is_refused(tmp_path):
    """Inside an accumulation window a save after step() is allowed
    (tests/checkpoint_io/test_checkpoint_safety.py); between a backward and its step() it is not."""
    with _engine(tmp_path, gas=2) as e:
        x = torch.randint(0, 37, (3, 5))
        e.backward(e(x).float().square().mean())
        with pytest.raises(RuntimeError, match="between a backward and the engine.step"):
            e.save_checkpoint(tmp_path / "ck")
        e.step()
        with pytest.raises(ValueError, match="checkpoint tag '../x'"):
            e.save_checkpoint(tmp_path / "ck", tag="../x")
    assert not (tmp_path / "ck" / "latest").exists()


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "missing file": (lambda d: (d / "global_step2/rank0/nvme/optim.1.swp").unlink(),
                     "file rank0/nvme/optim.1.swp is missing"),
    "wrong size": (lambda d: open(d / "global_step2/rank0/state.safetensors", "ab").write(b"\0"),
                   "state.safetensors has .* bytes, the manifest says"),
    "bad checksum": (lambda d: _flip_byte(d / "global_step2/rank0/nvme/optim.0.swp"),
                     r"optim.0.swp fails its CRC32C? check"),
    "missing manifest": (lambda d: (d / "global_step2/manifest.json").unlink(), "no manifest.json"),
    "garbled manifest": (lambda d: (d / "global_step2/manifest.json").write_text("{"), "not valid JSON"),
    "no latest": (lambda d: (d / "latest").unlink(), "no 'latest' file"),
    "tag not found": (lambda d: (d / "latest").write_text("global_step9\n"), "'global_step9' not found"),
    "world size": (lambda d: _edit_manifest(d, lambda m: m["model"].update(world_size=2)),
                   "rank1/state.safetensors is not in the manifest"),
    "precision": (lambda d: _edit_manifest(d, lambda m: m["model"].update(compute_dtype="bfloat16")),
                  "precision mismatch"),
}


def _edit_manifest(d, change):
    path = d / "global_step2" / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    with _engine(root, "cpu", "nvme") as e:
        runs.train(e, 2)
        e.save_checkpoint(root / "ck")
    return root / "ck"


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_bad_checkpoint_is_refused_before_anything_changes(tmp_path, saved, what):
    corrupt, message = CORRUPTIONS[what]
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    corrupt(ck)
    with _engine(tmp_path, "cpu", "nvme", seed=4) as e:
        runs.train(e, 1)
        before = runs.engine_state(e)
        with pytest.raises(CheckpointError, match=message):
            e.load_checkpoint(ck)
        runs.assert_same_state(before, runs.engine_state(e))
        runs.train(e, 1)  # still trains


@pytest.mark.parametrize("other", ["shape", "names"])
def test_checkpoint_of_another_model_is_refused(tmp_path, saved, other):
    model = TinyGPT(hidden=27) if other == "shape" else build("shared_param")
    cfg = make_config("cpu", "nvme", tmp_path / "swap", scheduler=runs.WARMUP)
    with offload.initialize(model, cfg) as e:
        before = runs.engine_state(e)
        message = r"parameter 'wte.weight' has shape \[37, 24\] in the checkpoint, \[37, 27\]" \
            if other == "shape" else "parameters in the checkpoint but not in the model"
        with pytest.raises(CheckpointError, match=message):
            e.load_checkpoint(saved)
        runs.assert_same_state(before, runs.engine_state(e))


def test_gather_16bit_weights_on_model_save_writes_the_consolidated_weights(tmp_path):
    """DeepSpeed's stage3_gather_16bit_weights_on_model_save: the 16-bit weights,
    consolidated into one safetensors file beside the checkpoint."""
    from safetensors.torch import load_file

    import offload
    from tests.support.harness import batches as make_batches, build as build_model, lm_loss as loss_of
    from tests.support.harness import make_config as config_of

    cfg = config_of("nvme", "cpu", tmp_path / "swap")
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    with offload.initialize(build_model("tiny_gpt"), cfg) as engine:
        for per_rank in make_batches(2, seed=2):
            x, y = per_rank[0]
            engine.backward(loss_of(engine(x), y))
            engine.step()
        tag = engine.save_checkpoint(tmp_path / "ckpt")
        masters = engine.full_state_dict(master=True)
    weights = load_file(tmp_path / "ckpt" / tag / "model_16bit.safetensors")
    assert set(weights) >= {"wte.weight", "wpe", "blocks.0.qkv.weight"}
    for name, w in weights.items():
        assert w.dtype == torch.bfloat16
        torch.testing.assert_close(w, masters[name].to(torch.bfloat16), rtol=0, atol=0)
