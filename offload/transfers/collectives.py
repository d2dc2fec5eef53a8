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
    Checkpoint saves and loads agree over ranks with torch's object
    collectives (all_gather_object, broadcast_object_list, barrier), which
    do not go through ProcessGroupInfo and are not counted."""

    def __init__(self):
        self._lock = threading.Lock()  # the optimizer and NVMe threads may run collectives too
        self._counts = {kind: [0, 0, 0] for kind in COLLECTIVE_KINDS}

    def add(self, kind: str, sent: int, received: int) -> None:
        with self._lock:
            counts = self._counts[kind]
            counts[0] += 1
            counts[1] += sent
            counts[2] += received

    def snapshot(self) -> dict[str, dict[str, int]]:
        """{kind: {"calls", "bytes_sent", "bytes_received"}}, a copy."""
        with self._lock:
            return {kind: {"calls": c, "bytes_sent": s, "bytes_received": r}
                    for kind, (c, s, r) in self._counts.items()}

    def reset(self) -> None:
        with self._lock:
            for counts in self._counts.values():
                counts[:] = [0, 0, 0]


class _GroupHandle:
    """The one reference to a torch ProcessGroup that an engine's objects share.

    Note [releasing the process group]
    Every ShardContext, store and checkpoint job of an engine holds the same
    ProcessGroupInfo, frozen, so the group is held through this handle and
    `ProcessGroupInfo.release()` (engine.close()) drops it everywhere at once.
    A gloo group kept alive past dist.destroy_process_group() is destroyed
    at the interpreter's exit, with its worker threads, and that aborted
    (SIGABRT) two-rank runs after a clean close. Two handles are
    equal when they hold the same group."""

    __slots__ = ("group", "released", "counter")

    def __init__(self, group):
        self.group, self.released = group, False
        self.counter = CollectiveCounter()  # outlives release: read after engine.close()

    def __eq__(self, other):
        return isinstance(other, _GroupHandle) and self.group is other.group and self.released == other.released

    def __hash__(self):
        return id(self.group)

    def __repr__(self):
        return "released" if self.released else repr(self.group)


@dataclass(frozen=True)
class ProcessGroupInfo:
    rank: int = 0
    world_size: int = 1
    _handle: _GroupHandle = field(default_factory=lambda: _GroupHandle(None), repr=False)

    @staticmethod
    def current() -> "ProcessGroupInfo":
        if dist.is_available() and dist.is_initialized():
            return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), _GroupHandle(dist.group.WORLD))
        return ProcessGroupInfo()

    @property
    def group(self):
        """The torch ProcessGroup (None: the default group, or one process)."""
        if self._handle.released and self.world_size > 1:
            raise RuntimeError(f"rank {self.rank}: this engine was closed and released its process group "
                               "(Note [releasing the process group]); a closed engine runs no collectives")
        return self._handle.group

    def release(self) -> None:
        """Drops the reference to the process group, for every holder of this info
        (Note [releasing the process group]). Collectives afterwards raise."""
        self._handle.group, self._handle.released = None, True

    def collective_counts(self) -> dict[str, dict[str, int]]:
        """What this engine's collectives carried so far, per kind (Note [collective
        bytes]): {kind: {"calls", "bytes_sent", "bytes_received"}}, a snapshot."""
        return self._handle.counter.snapshot()

    def reset_collective_counts(self) -> None:
        self._handle.counter.reset()

    def _count(self, kind: str, sent: torch.Tensor | None, received: torch.Tensor | None) -> None:
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        self._handle.counter.add(kind, nbytes(sent), nbytes(received))

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
        """mine (n) <- the mean over ranks of row `rank` of every rank's stacked (world, n).
        Summed, then divided by the world size, as an all_reduce average is (SUM and
        a division rather than ReduceOp.AVG: the same arithmetic as before buckets)."""
        if self.world_size == 1:
            mine.copy_(stacked.reshape(-1))
            return
        # reduce_scatter_single: the name from torch 2.13 on, where reduce_scatter_tensor
        # warns as deprecated; 2.11 has only reduce_scatter_tensor (the same collective).
        # Flat: gloo takes only the concatenated form (its check fails on a (world, n) input).
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(mine, stacked.view(-1), group=self.group)
        self._count("reduce_scatter", stacked, mine)
        mine.div_(self.world_size)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """tensor <- rank src's tensor, in place."""
        if self.world_size > 1:
            dist.broadcast(tensor, src, group=self.group)
            mine_sent = self.rank == src
            self._count("broadcast", tensor if mine_sent else None, None if mine_sent else tensor)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, group=self.group)
            self._count("all_reduce", value, value)
        return value

    def any_flag(self, flag: bool, device: torch.device) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        return bool(self.sum_scalar(t).item() > 0)
