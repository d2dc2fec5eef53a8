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
    rank a contiguous, disjoint block (where every local rank sees the same
    set; a launcher that bound each rank to its own set is left as it bound
    it). The host Adam's threads are this rank's block: torchrun sets
    OMP_NUM_THREADS=1 for every rank when it starts several, which left each
    rank's Adam on one core;
  - disks: free space on an nvme_path is checked for the sum of the files of
    every local rank whose nvme_path is on the same file system
    (engine/stores.py check_free_space).
Every figure can still be set: memory.host_budget, offload_optimizer.
cpuadam_cores_perc.
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


def affinity() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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


def node_share(pg) -> NodeShare:
    """This rank's share, agreed with the other ranks (a collective where pg has several)."""
    mine = (socket.gethostname(), tuple(affinity()))
    if pg.world_size == 1:
        return NodeShare(1, 0, mine[1], mine[0])
    import torch.distributed as dist

    everyone: list = [None] * pg.world_size
    dist.all_gather_object(everyone, mine, group=pg.group)
    local = [r for r, (host, _) in enumerate(everyone) if host == mine[0]]
    index = local.index(pg.rank)
    if all(everyone[r][1] == mine[1] for r in local):
        cores = split_cores(list(mine[1]), len(local), index)
    else:  # each rank bound to its own set already: keep it
        cores = mine[1]
    return NodeShare(len(local), index, cores, mine[0])
