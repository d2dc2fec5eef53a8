"""When the optimizer's updates run, decided in one place.

Note [update names]
An update runs at one of three times, each with one name, used everywhere:
  in backward   started as each final gradient arrives, during the backward
                that ends an accumulation window; step() completes them
                (OverlappedUpdates, UpdatePolicy.during_backward, phase
                UPDATING_IN_BACKWARD)
  deferred      started by step() and left running under the next forward
                (DeferredUpdates, UpdatePolicy.deferred, phase UPDATING_DEFERRED)
  carried       in-backward updates that step() does not wait for: carried
                under the next forward, each following its gradient's take-in
                (UpdatePolicy.carried, BackwardPlan.carried, OverlappedUpdates.carry,
                take_grad(carried=True), phase UPDATING_DEFERRED once step() ran)
Otherwise the update runs in step() (ShardedAdam.update). Head first
(GradientsToHost.head_first) is not a kind of update but the order in which
carried gradients are taken in.

Note [when updates run]
An update needs its shard's final gradient. It runs:
  during backward        as each gradient becomes final, on the host worker
                         (OverlappedUpdates; Note [optimizer overlap] in
                         step/updates.py), where nothing needs every
                         gradient first (no clipping, no fp16 overflow
                         check), the backward ends an accumulation window,
                         and there is something to hide: NVMe transfers, or
                         host Adam beside a separate device's backward. Host
                         Adam beside a CPU backward only takes cores from it
                         (measured: backward 0.79 s -> 1.06 s, GPT 67M, 2
                         cores);
  under the next forward  when step() could not start them during backward,
                         with host state beside a separate device, no state
                         and no home on NVMe (nothing in them can fail on a
                         file): DeferredUpdates, Note [updates under the next
                         forward];
  in step()              otherwise.
Updates started during backward go on under the next forward too, head
first, where each follows its gradient's take-in on the host worker: one
rank, host state beside a separate device, nothing on NVMe or in the
device's state, one micro-batch a step (`carried`; Note [head first
after backward] in transfers/device_copies.py).
While updates run during backward, the final gradients waiting for theirs
are capped (`pending_cap`: reduce_bucket_size, else two of the largest
partition, never under one); a step whose updates end each gradient's life
(one micro-batch a step, nothing needing every gradient first) holds at
most that cap plus the one being made and the one being updated
(`backlog_bound`), which the budgets reserve (engine/budgets.py).
UpdatePolicy answers all of it from the config and the device, for the
engine at each backward and step and for the budgets at initialize, so the
two cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.config import Config, Precision
from offload.tiers import Tier


@dataclass(frozen=True)
class UpdatePolicy:
    overlap_updates: bool  # offload_optimizer.overlap_updates, else zero_optimization.overlap_comm
    accumulation_steps: int | None
    clipping: bool
    fp16: bool
    separate_memory: bool
    reduce_bucket_size: int | None

    @classmethod
    def of(cls, config: Config, *, separate_memory: bool) -> "UpdatePolicy":
        clip = config.gradient_clipping
        zero = config.zero_optimization
        bucket = zero.reduce_bucket_size if isinstance(zero.reduce_bucket_size, int) else None
        gas = config.gradient_accumulation_steps if isinstance(config.gradient_accumulation_steps, int) else None
        overlap = zero.offload_optimizer.overlap_updates
        return cls(overlap_updates=zero.overlap_comm if overlap is None else overlap, accumulation_steps=gas,
                   clipping=isinstance(clip, (int, float)) and clip > 0,
                   fp16=config.precision is Precision.FP16, separate_memory=separate_memory,
                   reduce_bucket_size=bucket)

    @property
    def needs_every_gradient_first(self) -> bool:
        """Clipping by the global norm, or fp16's overflow check: no update before all are in."""
        return self.clipping or self.fp16

    def during_backward(self, state_tiers, *, at_boundary: bool) -> bool:
        """Whether this backward starts the updates (Note [when updates run])."""
        worth_it = Tier.NVME in state_tiers or (Tier.HOST in state_tiers and self.separate_memory)
        return worth_it and self.overlap_updates and at_boundary and not self.needs_every_gradient_first

    def deferred(self, state_tiers, homes) -> bool:
        """Whether step() may leave its updates running beside the next forward."""
        return (Tier.HOST in state_tiers and Tier.NVME not in state_tiers and self.separate_memory
                and self.overlap_updates and all(home is not Tier.NVME for home in homes))

    def carried(self, state_tiers, homes, *, world_size: int) -> bool:
        """Whether updates started during backward may go on under the next forward."""
        return (self.updates_free_gradients and self.deferred(state_tiers, homes)
                and Tier.DEVICE not in state_tiers and world_size == 1)

    @property
    def updates_free_gradients(self) -> bool:
        """Whether each update, run during backward, ends its gradient's life (one
        micro-batch a step, nothing needing every gradient first, overlap on)."""
        return self.accumulation_steps == 1 and not self.needs_every_gradient_first and self.overlap_updates

    def pending_cap(self, largest: int) -> int:
        """Elements of final gradients that may wait for their overlapped update."""
        return max(self.reduce_bucket_size or 2 * largest, largest)

    def backlog_bound(self, largest: int) -> int:
        """The most gradient elements held at once where updates free them: the cap,
        the gradient being made and the one being updated."""
        return self.pending_cap(largest) + 2 * largest

    def from_staging(self, shard, grad: torch.Tensor, optim_tier) -> bool:
        """Whether `grad`, just taken in from its pinned staging buffer during backward, is
        updated from it (Note [updates from the staging buffer] in step/gradients.py)."""
        return (shard.ctx.streams is not None and not shard.gradient.pending and optim_tier is Tier.HOST
                and shard.home is not Tier.NVME and grad.dtype in (torch.float32, torch.bfloat16)
                and grad.dim() == 1 and grad.numel() == shard.part_numel and grad.is_contiguous())
