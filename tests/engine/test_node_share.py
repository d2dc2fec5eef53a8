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
from tests.support.harness import batches, build, engine_weights, make_config, run_reference, train_engine
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
                        # The host Adam's threads run on this rank's block: the host worker thread
                        # and every native kernel worker (Note [the node's share]).
                        bound = engine._host_worker.submit(os.sched_getaffinity, 0).result()
                        assert sorted(bound) == sorted(node.cores)
                        for worker_cores in offload._native.native.kernel_thread_cores():
                            assert sorted(worker_cores) == sorted(node.cores)
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
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_one_host_share_its_memory_cores_and_disk(tmp_path, world):
    # tiny_gpt's swap files with nvme everywhere take 622,592 bytes a rank: the mount holds one rank's.
    with mounted_tmpfs(tmp_path, "900k", "the shared-disk case needs a small file system") as mnt:
        assert mnt == tmp_path / "mnt"
        with offload.initialize(build("tiny_gpt"), make_config("nvme", "nvme", mnt / "alone")):
            pass  # one rank alone fits
        outcome, procs = run_ranks(_worker, (str(tmp_path),), world=world)
    failures = {k: v for k, v in outcome.items() if v != "ok"}
    assert not failures, "\n".join(f"rank {r} {c}:\n{msg}" for (r, c), msg in failures.items())
    assert len(outcome) == 2 * world and [p.exitcode for p in procs] == [0] * world


def test_the_cores_are_split_numa_node_by_numa_node(tmp_path):
    """Two NUMA nodes whose second hyperthreads are numbered after every first one (node 0:
    0-3 and 8-11, node 1: 4-7 and 12-15): each of 4 ranks gets 4 cores of one node."""
    from offload.node import numa_nodes, numa_order

    for node, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node folder: ignored
    node_of = numa_nodes(str(tmp_path))
    assert node_of == {**{c: 0 for c in (0, 1, 2, 3, 8, 9, 10, 11)}, **{c: 1 for c in (4, 5, 6, 7, 12, 13, 14, 15)}}
    ordered = numa_order(range(16), node_of)
    blocks = [split_cores(ordered, 4, i) for i in range(4)]
    assert blocks == [(0, 1, 2, 3), (8, 9, 10, 11), (4, 5, 6, 7), (12, 13, 14, 15)]
    assert all(len({node_of[c] for c in b}) == 1 for b in blocks)
    assert numa_nodes(str(tmp_path / "absent")) == {}


def _run_kernel_on_threads(threads: int) -> None:
    """One native Adam update on `threads` kernel threads (its pool makes the workers it lacks)."""
    from offload.ops.adam import adam_step

    n = 1 << 20  # large enough for the kernel to split it among threads
    master, grad, m, v = (torch.rand(n) for _ in range(4))
    adam_step(master, grad, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              num_threads=threads)


def test_the_kernel_threads_are_bound_to_the_ranks_cores():
    """A rank's block of cores binds the native kernels' workers, now and later, and the
    host worker thread; a single rank's share (every core) leaves them free again."""
    from offload._native import native
    from offload.host_worker import HostWorker
    from offload.node import NodeShare, affinity, bind_kernel_threads

    if native is None:
        pytest.skip("the native extension is not built")
    everything = affinity()
    worker = HostWorker()
    try:
        bind_kernel_threads(NodeShare(2, 1, (everything[-1],), "here"), worker)
        assert worker.submit(os.sched_getaffinity, 0).result() == {everything[-1]}
        _run_kernel_on_threads(2)  # a worker thread made after the binding is bound too
        assert native.kernel_thread_cores() and all(c == [everything[-1]] for c in native.kernel_thread_cores())
        bind_kernel_threads(NodeShare(1, 0, tuple(everything), "here"), worker)
        assert worker.submit(os.sched_getaffinity, 0).result() == set(everything)
        assert all(c == everything for c in native.kernel_thread_cores())
    finally:
        worker.shutdown()
