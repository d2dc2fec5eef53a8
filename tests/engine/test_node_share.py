"""Ranks that share one host plan for their share of it (Note [the node's share] in
offload/node.py): host memory, cores and disk divided among the job's ranks on the host."""
import os
import traceback
import warnings

import psutil
import pytest
import torch
import torch.distributed as dist

import offload
from offload.node import split_cores
from offload.placement import HOST_SHARE

from tests.aio.tmpfs import mounted_tmpfs
from tests.engine.harness import batches, build, engine_weights, make_config, run_reference, train_engine
from tests.engine.ranks import run_ranks


def test_a_64_core_host_with_8_ranks_gives_each_8_disjoint_cores():
    blocks = [split_cores(list(range(64)), 8, i) for i in range(8)]
    assert [len(b) for b in blocks] == [8] * 8
    assert sorted(c for b in blocks for c in b) == list(range(64))  # disjoint, every core used
    assert blocks[3] == tuple(range(24, 32))
    assert [len(split_cores(list(range(10)), 4, i)) for i in range(4)] == [2, 3, 2, 3]
    assert split_cores([0, 1], 4, 3) == (1,)  # fewer cores than ranks: one each, shared


def test_one_rank_under_torchruns_omp_num_threads_1_runs_its_adam_on_every_core(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cpu")
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives
    try:
        with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path)) as engine:
            cores = len(os.sched_getaffinity(0))
            assert engine.node.local_ranks == 1 and engine.optimizer.step_threads == cores
    finally:
        torch.set_num_threads(torch_threads)


def _worker(rank, world, port, root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OFFLOAD_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # The collectives by each torch release's current names: 2.13 warns on every call of the old ones.
    warnings.filterwarnings("error", message=r".*is deprecated\. Please use `torch\.distributed")
    try:
        for case in ("plan", "disk"):
            try:
                if case == "plan":
                    model, data = build("tiny_gpt"), batches(4, world=world, seed=3)
                    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2,
                                                          weight_decay=0.01, world=world)
                    cfg = make_config("auto", "auto", root)
                    for key in ("offload_param", "offload_optimizer"):
                        cfg["zero_optimization"][key]["nvme_path"] = os.path.join(root, "swap")
                    with offload.initialize(model, cfg) as engine:
                        losses = train_engine(engine, data, rank=rank)
                        weights = engine_weights(engine)
                        node, host_plan = engine.node, engine.placement().budgets.host
                        threads = engine.optimizer.step_threads
                    assert node.local_ranks == world and node.local_index == rank
                    # Each rank's host plan is its share: together within HOST_SHARE of the RAM.
                    assert host_plan * world <= HOST_SHARE * psutil.virtual_memory().total
                    cores = sorted(os.sched_getaffinity(0))
                    assert threads == len(node.cores) and set(node.cores) <= set(cores)
                    gathered = [None] * world
                    dist.all_gather_object(gathered, (node.cores, threads, host_plan))
                    every = [c for cs, _, _ in gathered for c in cs]
                    if len(cores) >= world:
                        assert sorted(every) == cores and len(set(every)) == len(every)  # disjoint, all
                        assert sum(t for _, t, _ in gathered) == len(cores)
                    torch.testing.assert_close(losses, ref_losses[:, rank])
                    for name, p in ref_model.named_parameters():
                        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
                else:  # the shared disk: room for one rank's files, not two
                    mnt = os.path.join(root, "mnt")
                    cfg = make_config("nvme", "nvme", os.path.join(mnt, f"rank{rank}"))
                    with pytest.raises(OSError, match=r"not enough free space.*rank \d's \d+ bytes"):
                        offload.initialize(build("tiny_gpt"), cfg)
                    assert not any(os.scandir(mnt)) or all(e.name.startswith("rank") for e in os.scandir(mnt))
                    assert not any(f.is_file() for d, _, fs in os.walk(mnt) for f in map(
                        lambda n: __import__("pathlib").Path(d, n), fs))
                results.put((rank, case, "ok"))
            except Exception:  # noqa: BLE001 - reported to the parent test
                results.put((rank, case, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_on_one_host_share_its_memory_cores_and_disk(tmp_path):
    # tiny_gpt's swap files with nvme everywhere take 622,592 bytes a rank: the mount holds one rank's.
    with mounted_tmpfs(tmp_path, "900k", "the shared-disk case needs a small file system") as mnt:
        assert mnt == tmp_path / "mnt"
        with offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", mnt / "alone")):
            pass  # one rank alone fits
        outcome, procs = run_ranks(_worker, (str(tmp_path),))
    failures = {k: v for k, v in outcome.items() if v != "ok"}
    assert not failures, "\n".join(f"rank {r} {c}:\n{msg}" for (r, c), msg in failures.items())
    assert len(outcome) == 4 and [p.exitcode for p in procs] == [0, 0]
