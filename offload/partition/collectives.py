"""The few collectives the parameter manager needs, over torch.distributed.

World size 1 (or no process group) short-circuits to local copies, so the
single-process path never touches torch.distributed. Gradients are
reduce-scattered, several to a collective (Note [gradient buckets] in
grad_buckets.py); gloo and NCCL both run it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class _GroupHandle:
    """The one reference to a torch ProcessGroup that an engine's objects share.

    Note [releasing the process group]
    Every ShardContext, store and checkpoint job of an engine holds the same
    ProcessGroupInfo, frozen, so the group is held through this handle and
    `ProcessGroupInfo.release()` (engine.close()) drops it everywhere at once.
    A gloo group kept alive past dist.destroy_process_group() is destroyed
    at the interpreter's exit, with its worker threads, and that aborted
    (SIGABRT) two-rank runs after a clean close (issue 16). Two handles are
    equal when they hold the same group."""

    __slots__ = ("group", "released")

    def __init__(self, group):
        self.group, self.released = group, False

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

    def all_gather(self, out_flat: torch.Tensor, part: torch.Tensor) -> None:
        """out_flat (world * part.numel()) <- every rank's part, in rank order."""
        if self.world_size == 1:
            out_flat.copy_(part)
            return
        dist.all_gather_into_tensor(out_flat, part.to(out_flat.device), group=self.group)

    def reduce_scatter_mean(self, mine: torch.Tensor, stacked: torch.Tensor) -> None:
        """mine (n) <- the mean over ranks of row `rank` of every rank's stacked (world, n).
        Summed, then divided by the world size, as an all_reduce average is (SUM and
        a division rather than ReduceOp.AVG: the same arithmetic as before buckets)."""
        if self.world_size == 1:
            mine.copy_(stacked.reshape(-1))
            return
        # reduce_scatter_single: torch 2.13's name; reduce_scatter_tensor warns as deprecated.
        # Flat: gloo takes only the concatenated form (its check fails on a (world, n) input).
        dist.reduce_scatter_single(mine, stacked.view(-1), group=self.group)
        mine.div_(self.world_size)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """tensor <- rank src's tensor, in place."""
        if self.world_size > 1:
            dist.broadcast(tensor, src, group=self.group)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, group=self.group)
        return value

    def any_flag(self, flag: bool, device: torch.device) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        return bool(self.sum_scalar(t).item() > 0)
