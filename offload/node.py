"""What a rank shares with the other ranks of its job on one host.

Note [the node's share]
Under torchrun several ranks run on one host and share its RAM, its cores and
its disks; each rank's plan is made for its share, not for the whole host:
  - local_ranks: the job's ranks on this host (ranks whose hostname is this
    rank's, asked of every rank once at initialize);
  - host memory: an auto plan's default host budget is HOST_SHARE of the
    memory available, divided among the local ranks (each rank alone once
    took 75% of the host: two ranks planned 1.32x the RAM and one was
    OOM-killed);
  - cores: the process's CPU affinity divided among the local ranks, each
    rank a contiguous, disjoint block, the cores taken NUMA node by NUMA node
    where the kernel shows the topology (where every local rank sees the same
    set; a launcher that bound each rank to its own set is left as it bound
    it). The host Adam runs as many threads as its block has cores, bound to
    them: the native kernels' worker threads and the host worker thread
    (bind_kernel_threads; the user's own threads are left as they are).
    torchrun sets OMP_NUM_THREADS=1 for every rank when it starts several,
    which left each rank's Adam on one core; unbound, 8 ranks' threads
    would share and migrate across every core;
  - pinned memory: the checkpoint-input pool's default bound (without
    memory.pinned_budget) is the rank's share of the host's; pinned host
    homes are bounded by the rank's host budget already;
  - disks: free space on an nvme_path is checked for the sum of the files of
    every local rank whose nvme_path is on the same file system
    (engine/stores.py check_free_space).
Every figure can still be set: memory.host_budget, offload_optimizer.
cpuadam_cores_perc.

Note [node names]
A node, for the layout of the shards (Note [hybrid sharding] in
transfers/layout.py), is the ranks joined by fast links: by default the
ranks of one torchrun launch on one host, named host:GROUP_RANK (torchrun's
node rank; the host alone without torchrun). OFFLOAD_NODE names it instead,
per rank. Two `torchrun --nnodes 2` launches on one host are then two nodes,
which is how a two-node job is tested on one machine; they still share that
host's memory, cores and disks, which go by the host alone (above).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeShare:
    """This rank's share of its host (Note [the node's share])."""

    local_ranks: int = 1  # the job's ranks on this host, this one included
    local_index: int = 0  # this rank's place among them
    cores: tuple[int, ...] = ()  # this rank's cores (its block of the process's affinity)
    host: str = ""

    @property
    def threads(self) -> int:
        return max(1, len(self.cores))

    def describe(self) -> str:
        """The node view, one line: for the printed plan and `offload report`."""
        return (f"host {self.host}: rank {self.local_index} of {self.local_ranks} here, "
                f"{self.threads} Adam threads on cores {_ranges(self.cores)}")


def _ranges(cores) -> str:
    """0-7,16-23 for a sorted list of cores."""
    out, start, prev = [], None, None
    for c in sorted(cores):
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = c
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out) or "none"


def launcher_share() -> NodeShare:
    """This process's share as the launcher's environment tells it (LOCAL_WORLD_SIZE and
    LOCAL_RANK, as torchrun sets them), without a process group: `offload report`."""
    def env_int(name: str, default: int) -> int:
        try:
            return max(0, int(os.environ.get(name, default)))
        except ValueError:
            return default

    ranks = max(1, env_int("LOCAL_WORLD_SIZE", 1))
    index = min(env_int("LOCAL_RANK", 0), ranks - 1)
    return NodeShare(ranks, index, split_cores(affinity(), ranks, index), socket.gethostname())


def node_view() -> dict:
    """What `offload report` says of this rank's share of its host (Note [the node's share])."""
    import psutil

    from offload.activations.saver import PINNED_INPUTS_SHARE
    from offload.placement import HOST_SHARE

    share, mem = launcher_share(), psutil.virtual_memory()
    return {"host": share.host, "node": node_name(), "local_ranks": share.local_ranks, "local_rank": share.local_index,
            "cores": _ranges(share.cores), "adam_threads": share.threads,
            "default_host_budget": int(HOST_SHARE * mem.available) // share.local_ranks,
            "default_pinned_input_bound": int(PINNED_INPUTS_SHARE * mem.total) // share.local_ranks}


def bind_kernel_threads(share: NodeShare, host_worker) -> None:
    """Binds the host Adam's threads to this rank's cores: the native kernels' workers
    (now and later) and the host worker thread that runs the overlapped updates."""
    from offload import _native

    if _native.available():
        _native.native.bind_kernel_threads(list(share.cores))
    if host_worker is not None and hasattr(os, "sched_setaffinity") and share.cores:
        host_worker.submit(os.sched_setaffinity, 0, share.cores).result()


def affinity() -> list[int]:
    """The cores this process may run on, NUMA node by NUMA node (numa_order)."""
    if hasattr(os, "sched_getaffinity"):
        return numa_order(os.sched_getaffinity(0), numa_nodes())
    return list(range(os.cpu_count() or 1))


def numa_nodes(root: str = "/sys/devices/system/node") -> dict[int, int]:
    """Core -> NUMA node, where the kernel shows the topology; {} else."""
    nodes = {}
    try:
        entries = [e for e in os.listdir(root) if e.startswith("node") and e[4:].isdigit()]
    except OSError:
        return {}
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "cpulist")) as f:
                text = f.read().strip()
        except OSError:
            continue
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            for core in range(int(lo), int(hi or lo) + 1):
                nodes[core] = int(entry[4:])
    return nodes


def numa_order(cores, node_of: dict[int, int]) -> list[int]:
    """`cores` sorted by NUMA node, then by number: split_cores's contiguous blocks then
    fall within one node where the ranks divide the nodes evenly (a host whose second
    hyperthreads are numbered after every node's first ones keeps each rank's threads
    on its node's memory)."""
    return sorted(cores, key=lambda c: (node_of.get(c, 0), c))


def split_cores(cores: list[int], local_ranks: int, local_index: int) -> tuple[int, ...]:
    """The contiguous block of `cores` that local rank `local_index` of `local_ranks` takes:
    disjoint blocks covering every core, sizes differing by at most one; one core each
    where there are fewer cores than ranks (shared, then)."""
    if local_ranks <= 1:
        return tuple(cores)
    n = len(cores)
    if n < local_ranks:
        return (cores[local_index % n],)
    return tuple(cores[local_index * n // local_ranks:(local_index + 1) * n // local_ranks])


def node_name() -> str:
    """This rank's node (Note [node names])."""
    stated = os.environ.get("OFFLOAD_NODE", "").strip()
    if stated:
        return stated
    group = os.environ.get("GROUP_RANK", "").strip()
    return f"{socket.gethostname()}:{group}" if group else socket.gethostname()


def node_share(pg) -> NodeShare:
    """This rank's share, agreed with the other ranks (a collective where pg has several)."""
    mine = (socket.gethostname(), tuple(affinity()))
    if pg.job_size == 1:
        return NodeShare(1, 0, mine[1], mine[0])
    import torch.distributed as dist

    everyone: list = [None] * pg.job_size
    dist.all_gather_object(everyone, mine, group=pg.job_group)
    local = [r for r, (host, _) in enumerate(everyone) if host == mine[0]]
    index = local.index(pg.job_rank)
    if all(everyone[r][1] == mine[1] for r in local):
        cores = split_cores(list(mine[1]), len(local), index)
    else:  # each rank bound to its own set already: keep it
        cores = mine[1]
    return NodeShare(len(local), index, cores, mine[0])
