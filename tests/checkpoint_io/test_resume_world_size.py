"""Resuming at another world size (Note [resuming at another world size] in
offload/checkpoint_io/load.py): 2 ranks -> 1 and 1 -> 2, Adam state re-partitioned
exactly, bitwise against a run at the new size started from the same state
(tests/checkpoint_io/world_size_runs.py). Workers are spawned gloo processes; every
worker's exit code is checked."""
import json
import shutil

import pytest
import torch

import offload
from offload.checkpoint_io import CheckpointError
from tests.checkpoint_io import checkpoint_runs as runs
from tests.support.harness import build, make_config
from tests.checkpoint_io import world_size_runs as ws


def _assert_equal(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_equal(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    else:
        assert a == b, what


def _check(root, world):
    for rank in range(world):
        out = torch.load(root / f"resumed{world}.rank{rank}.pt", weights_only=False)
        # Right after the load: this rank's partition of every saved tensor, element for element.
        _assert_equal(out["at_load"]["state"], out["expected_at_load"], f"rank {rank} state at load")
        # Then the same training as a run started at this size from the same state.
        _assert_equal(out["x"]["masters"], out["y"]["masters"], f"rank {rank} masters")
        _assert_equal(out["x"]["optim"]["state"], out["y"]["optim"]["state"], f"rank {rank} Adam state")
        _assert_equal(out["x"]["sched"], out["y"]["sched"], f"rank {rank} schedule")
        assert out["x"]["counters"] == out["y"]["counters"] == (2 * ws.STEPS, 2 * ws.STEPS)


@pytest.mark.slow
def test_two_ranks_resume_on_one(tmp_path):
    tiers = ("cpu", "nvme")
    ws.run_ranks("first_run", (tmp_path, tiers), world=2)
    ws.resume(tmp_path, tiers, saved_world=2, world=1, rank=0)
    _check(tmp_path, 1)


@pytest.mark.slow
def test_one_rank_resumes_on_two(tmp_path):
    tiers = ("nvme", "nvme")  # the fp32 master shared with the parameter's file
    ws.first_run(tmp_path, tiers, world=1, rank=0)
    ws.run_ranks("resume", (tmp_path, tiers, 1), world=2)
    _check(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [["n0", "n0"], ["n0", "n1"]], ids=["one node of two", "two nodes of one"])
def test_two_nodes_of_two_resume_hybrid_at_another_layout(tmp_path, nodes):
    """Saved by the hybrid layout at 2 nodes x 2 ranks (group 0 writes its two partitions:
    Note [hybrid sharding]); resumed on one node of two ranks (the same partitions, one
    group) and on two nodes of one rank each (two groups of one: every rank a whole copy)."""
    tiers = ("cpu", "nvme")
    ws.run_ranks("first_run", (tmp_path, tiers), world=4, nodes=["n0", "n0", "n1", "n1"])
    saved = json.loads((tmp_path / "ck" / "global_step2" / "manifest.json").read_text())
    assert saved["model"]["world_size"] == 2  # the partitions of one group
    ws.run_ranks("resume", (tmp_path, tiers, 2), world=2, nodes=nodes)
    _check(tmp_path, 2)


def test_checkpoint_saved_inside_a_window_is_refused_at_another_world_size(tmp_path):
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path / "s", gas=2)) as e:
        runs.train(e, 1)
        e.save_checkpoint(tmp_path / "ck")
    # As if two ranks had saved it: rank 1's files beside rank 0's.
    tag = tmp_path / "ck" / "global_step0"
    shutil.copytree(tag / "rank0", tag / "rank1")
    manifest = json.loads((tag / "manifest.json").read_text())
    manifest["model"]["world_size"] = 2
    manifest["files"].update({k.replace("rank0/", "rank1/"): v for k, v in list(manifest["files"].items())})
    for p in manifest["model"]["parameters"]:
        p["part_numel"] = -(-p["part_numel"] // 2)
    (tag / "manifest.json").write_text(json.dumps(manifest))
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path / "s2", gas=2)) as e:
        with pytest.raises(CheckpointError, match=r"saved inside a gradient accumulation window .* by 2 rank\(s\)"):
            e.load_checkpoint(tmp_path / "ck")
