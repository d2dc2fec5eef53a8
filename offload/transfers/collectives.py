"""The few collectives the parameter manager needs, over torch.distributed.

World size 1 (or no process group) short-circuits to local copies, so the
single-process path never touches torch.distributed. Gradients are
reduce-scattered, several to a collective (Note [gradient buckets] in
grad_buckets.py); gloo and NCCL both run it. Every collective run here is
counted, calls and bytes per kind (Note [collective bytes]).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
# The links a collective's ranks are joined by (Note [link classes]).
LINKS = ("within_node", "across_nodes")


class CollectiveCounter:
    """Calls and bytes of the collectives one engine ran, per kind.

    Note [collective bytes]
    Every collective of the engine's training path goes through
    ProcessGroupInfo, and each one it runs (world size above 1; a single
    process runs none and counts none) is counted here, per kind, from this
    rank's side: `calls`, `bytes_sent` (the input tensor this rank hands in)
    and `bytes_received` (the output tensor it gets back, its own share
    included). These are the bytes of the tensors, not the wire traffic of
    the algorithm (a ring moves (W-1)/W of the full tensor per rank for a
    reduce-scatter or an all-gather, twice that for an all_reduce).
      all_gather      sent: the partition (padded/W elements), received: the
                      padded full parameter (padded elements)
      reduce_scatter  sent: the bucket, every gradient it packs padded and in
                      fp32 (sum of padded * 4 bytes), received: this rank's
                      partitions of them (that / W)
      all_reduce      sent = received: the tensor (scalars: the gradient norm
                      each step records, fp16's overflow flag, close's memory flag)
      broadcast       sent on the source rank, received on the others
    So one training step with W ranks and fp32 buckets carries, per rank,
      reduce_scatter  4 * sum over trained parameters of padded numel, sent,
                      in one call per bucket (Note [gradient buckets])
      all_gather      itemsize * sum over gathers of padded numel, received:
                      each offloaded parameter once when forward takes it into
                      use and once more when backward needs it again, unless
                      kept gathered across the turn (Note [prefetch order])
                      (parameters homed on the device, offload_param none, are
                      instead all-gathered once after their update)
      all_reduce      a few scalars, never a gradient
    (tests/engine/test_collective_bytes.py checks this against the counter).
    With a hybrid layout (Note [hybrid sharding] in transfers/layout.py) W
    above is the shard group's size, and at the accumulation window's last
    backward each rank also all_reduces its fp32 gradient partitions with its
    replicas: 4 * P / W sent and received, one call per bucket (Note
    [gradients across groups once a window] in grad_buckets.py). Every count
    is kept per link class (Note [link classes]).
    Checkpoint saves and loads agree over ranks with torch's object
    collectives (all_gather_object, broadcast_object_list, barrier), which
    do not go through ProcessGroupInfo and are not counted."""

    def __init__(self):
        self._lock = threading.Lock()  # the optimizer and NVMe threads may run collectives too
        self._counts = {(link, kind): [0, 0, 0] for link in LINKS for kind in COLLECTIVE_KINDS}

    def add(self, kind: str, sent: int, received: int, link: str = "within_node") -> None:
        with self._lock:
            counts = self._counts[(link, kind)]
            counts[0] += 1
            counts[1] += sent
            counts[2] += received

    def snapshot(self, link: str | None = None) -> dict[str, dict[str, int]]:
        """{kind: {"calls", "bytes_sent", "bytes_received"}}, a copy: over one link class,
        or summed over both (None)."""
        links = LINKS if link is None else (link,)
        with self._lock:
            return {kind: dict(zip(("calls", "bytes_sent", "bytes_received"),
                                   (sum(self._counts[(l, kind)][i] for l in links) for i in range(3))))
                    for kind in COLLECTIVE_KINDS}

    def reset(self) -> None:
        with self._lock:
            for counts in self._counts.values():
                counts[:] = [0, 0, 0]


class _GroupHandle:
    """The one reference to the torch ProcessGroups that an engine's objects share.

    Note [releasing the process group]
    Every ShardContext, store and checkpoint job of an engine holds the same
    ProcessGroupInfo, frozen, so the groups are held through this handle and
    `ProcessGroupInfo.release()` (engine.close()) drops them everywhere at once.
    A gloo group kept alive past dist.destroy_process_group() is destroyed
    at the interpreter's exit, with its worker threads, and that aborted
    (SIGABRT) two-rank runs after a clean close. The subgroups a hybrid layout
    made (Note [hybrid sharding]) are destroyed at release. Two handles are
    equal when they hold the same groups.

    Note [link classes]
    Each group's collectives are counted under the slowest link its ranks
    span: "within_node" where every rank of the group is on one node,
    "across_nodes" where it spans nodes (a node as transfers/layout.py names
    it). A flat layout over two nodes counts everything across nodes; a
    hybrid one counts its gathers within a node and only its gradients'
    all_reduce across."""

    __slots__ = ("group", "replica_group", "job_group", "links", "made", "released", "counter")

    def __init__(self, group, replica_group=None, job_group=None, *, links=("within_node", "within_node"),
                 made=()):
        self.group, self.replica_group, self.released = group, replica_group, False
        self.job_group = job_group if job_group is not None else group  # the whole job's ranks
        self.links, self.made = links, tuple(made)  # made: subgroups this handle destroys at release
        self.counter = CollectiveCounter()  # outlives release: read after engine.close()

    def __eq__(self, other):
        return (isinstance(other, _GroupHandle) and self.group is other.group
                and self.replica_group is other.replica_group and self.released == other.released)

    def __hash__(self):
        return id(self.group)

    def __repr__(self):
        return "released" if self.released else repr(self.group)


@dataclass(frozen=True)
class ProcessGroupInfo:
    """The ranks this engine's collectives run over.

    `rank` and `world_size` are this rank's place in its shard group, the ranks
    every parameter is partitioned over (the whole job in the flat layout).
    `replica` and `replicas`: which of the groups holding a copy of the
    partitions this rank's is, and how many there are (1 in the flat layout;
    Note [hybrid sharding] in transfers/layout.py). The job's ranks are
    numbered group by group: job rank = replica * world_size + rank."""

    rank: int = 0
    world_size: int = 1
    replica: int = 0
    replicas: int = 1
    _handle: _GroupHandle = field(default_factory=lambda: _GroupHandle(None), repr=False)

    @staticmethod
    def current() -> "ProcessGroupInfo":
        """The flat layout over torch.distributed's default group (one process: none)."""
        if dist.is_available() and dist.is_initialized():
            return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), 0, 1, _GroupHandle(dist.group.WORLD))
        return ProcessGroupInfo()

    @property
    def job_rank(self) -> int:
        return self.replica * self.world_size + self.rank

    @property
    def job_size(self) -> int:
        """Every rank of the job: the data-parallel world size."""
        return self.replicas * self.world_size

    @property
    def group(self):
        """The shard group's torch ProcessGroup (None: the default group, or one process)."""
        self._check_open()
        return self._handle.group

    @property
    def job_group(self):
        """The whole job's ProcessGroup: what every rank must agree on (checkpoints, the node)."""
        self._check_open()
        return self._handle.job_group

    def _check_open(self) -> None:
        if self._handle.released and self.job_size > 1:
            raise RuntimeError(f"rank {self.job_rank}: this engine was closed and released its process group "
                               "(Note [releasing the process group]); a closed engine runs no collectives")

    def release(self) -> None:
        """Drops the reference to the process groups, for every holder of this info
        (Note [releasing the process group]). Collectives afterwards raise."""
        handle = self._handle
        made, handle.made = handle.made, ()
        handle.group = handle.replica_group = handle.job_group = None
        handle.released = True
        for group in made:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # the default group went first: nothing left to destroy
                pass

    @property
    def links(self) -> dict[str, str]:
        """The link class of the shard group and of the replica group (Note [link classes])."""
        return {"shard": self._handle.links[0], "replica": self._handle.links[1]}

    def collective_counts(self, link: str | None = None) -> dict[str, dict[str, int]]:
        """What this engine's collectives carried so far, per kind (Note [collective
        bytes]): {kind: {"calls", "bytes_sent", "bytes_received"}}, a snapshot, over one
        link class ("within_node", "across_nodes") or both (None)."""
        return self._handle.counter.snapshot(link)

    def reset_collective_counts(self) -> None:
        self._handle.counter.reset()

    def _count(self, kind: str, sent: torch.Tensor | None, received: torch.Tensor | None,
               over: str = "shard") -> None:
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        link = self._handle.links[0 if over == "shard" else 1] if over != "job" else self._job_link()
        self._handle.counter.add(kind, nbytes(sent), nbytes(received), link)

    def _job_link(self) -> str:
        return "across_nodes" if "across_nodes" in self._handle.links else "within_node"

    @staticmethod
    def _all_gather(*args, **kwargs):
        # all_gather_single: the name from torch 2.13 on, where all_gather_into_tensor warns as
        # deprecated on every call; 2.11 has only all_gather_into_tensor (the same collective).
        return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)

    def all_gather(self, out_flat: torch.Tensor, part: torch.Tensor) -> None:
        """out_flat (world * part.numel()) <- every rank's part, in rank order."""
        if self.world_size == 1:
            out_flat.copy_(part)
            return
        self._all_gather(out_flat, part.to(out_flat.device), group=self.group)
        self._count("all_gather", part, out_flat)

    def all_gather_async(self, out_flat: torch.Tensor, part: torch.Tensor):
        """all_gather started, not waited: returns what to wait() on before out_flat is
        read; `part` must stay unchanged until then (Note [all-gathers ahead])."""
        if self.world_size == 1:
            raise ValueError("all_gather_async is for several ranks")
        work = self._all_gather(out_flat, part, group=self.group, async_op=True)
        self._count("all_gather", part, out_flat)
        return work

    def reduce_scatter_mean(self, mine: torch.Tensor, stacked: torch.Tensor) -> None:
        """mine (n) <- this shard group's share of the mean over the job's ranks of row
        `rank` of every rank's stacked (world, n): summed over the group, divided by the
        job's size (SUM and a division rather than ReduceOp.AVG: the same arithmetic as
        before buckets). With one group that is the mean; with several, sum_across_groups
        completes it (Note [gradients across groups once a window] in grad_buckets.py)."""
        if self.job_size == 1:
            mine.copy_(stacked.reshape(-1))
            return
        if self.world_size == 1:
            mine.copy_(stacked.reshape(-1))
        else:
            # reduce_scatter_single: the name from torch 2.13 on, where reduce_scatter_tensor
            # warns as deprecated; 2.11 has only reduce_scatter_tensor (the same collective).
            # Flat: gloo takes only the concatenated form (its check fails on a (world, n) input).
            reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            reduce_scatter(mine, stacked.view(-1), group=self.group)
            self._count("reduce_scatter", stacked, mine)
        mine.div_(self.job_size)

    def sum_across_groups(self, mine: torch.Tensor) -> None:
        """mine <- its sum over the replicas: the ranks of the other groups holding the same
        partition (Note [hybrid sharding]); nothing with one group."""
        if self.replicas > 1:
            dist.all_reduce(mine, group=self._handle.replica_group)
            self._count("all_reduce", mine, mine, over="replica")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """tensor <- job rank src's tensor, in place, on every rank of the job."""
        if self.job_size > 1:
            dist.broadcast(tensor, src, group=self.job_group)
            mine_sent = self.job_rank == src
            self._count("broadcast", tensor if mine_sent else None, None if mine_sent else tensor, over="job")

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over the shard group: the replicas hold the same partitions."""
        if self.world_size > 1:
            dist.all_reduce(value, group=self.group)
            self._count("all_reduce", value, value)
        return value

    def any_flag(self, flag: bool, device: torch.device) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        return bool(self.sum_scalar(t).item() > 0)
