"""A shard's fp32 gradient partition (a base of Shard).

Note [gradient partitions]
With optimizer state on the host or device, each shard keeps an fp32
gradient partition for the whole run (allocated at initialize; the first
gradient of each accumulation window replaces it). Where partitions are lazy
(lazy_grads, decided by engine/budgets.py `lazy_gradients`) a partition exists
only from the shard's first gradient of an accumulation window until its
update, and with one rank an fp32 gradient is taken over from autograd, not
copied. They are lazy with optimizer state on NVMe, where host memory is what
offload is short of, and beside a device with memory of its own whose updates
end their gradients' lives in backward: there an update reads its gradient
from the pinned staging buffer, and a partition kept for the run would never
be read.
"""
from __future__ import annotations

import torch

from offload.tiers import Tier


class ShardGradient:
    """Shard's gradient partition: `grad_part` on `grad_tier`, `has_grad` while one is pending
    (the attributes are Shard's, set in its constructor)."""

    @property
    def grad_device(self) -> torch.device:
        return self.ctx.device if self.grad_tier is Tier.DEVICE else torch.device("cpu")

    def allocate_grad_part(self) -> None:
        self.ctx.account.charge(self.grad_tier, self.part_numel * 4, f"gradient of {self.name}")
        self.grad_part = torch.zeros(self.part_numel, dtype=torch.float32, device=self.grad_device)
        self._grad_charged = True

    def take_grad(self, grad: torch.Tensor, owned: bool = False) -> None:
        """Adds this rank's gradient partition, averaged over ranks, into grad_part (fp32).
        With one rank that is the whole gradient, any shape; with several, the
        part_numel elements a reduce-scatter gave this rank (Note [gradient buckets]).
        owned: `grad` is autograd's own tensor, which nothing else reuses (else a
        view of a staging buffer or a bucket, copied from)."""
        self.await_update()  # the update reading the last window's gradient
        mine = grad.detach().reshape(-1)
        if mine.numel() < self.part_numel:  # an empty parameter's partition is one padding element
            mine = torch.zeros(self.part_numel, dtype=torch.float32, device=mine.device)
        elif mine.numel() != self.part_numel:
            raise ValueError(f"gradient of {self.name}: {mine.numel()} elements, expected this rank's "
                             f"partition of {self.part_numel}")
        if self.has_grad:
            self.grad_part.add_(mine.to(self.grad_part.device, torch.float32))
        else:
            # The window's first gradient replaces the partition (no zeroing
            # pass between steps): autograd's own fp32 tensor is taken over;
            # anything else (a view into a staging buffer or a bucket, another
            # dtype) is copied into the partition kept from the last step. A fresh one per step cost a page fault per 4 KiB
            # (879k a step, 2.5 s of system time, GPT 0.94B on a GPU host).
            if self.grad_part is None:
                self.ctx.account.charge(self.grad_tier, self.part_numel * 4, f"gradient of {self.name}")
                self._grad_charged = True
            if (owned and mine.dtype == torch.float32 and mine.device == torch.device(self.grad_device)
                    and mine.is_contiguous() and mine.untyped_storage().nbytes() == self.part_numel * 4):
                self.grad_part = mine
            elif self.grad_part is not None:
                self.grad_part.copy_(mine)
            else:
                self.grad_part = mine.to(self.grad_device, torch.float32, copy=True)
        self.has_grad = True

    def clear_grad(self, *, applied: bool = False) -> None:
        """After the shard's update (applied: called by the update itself) or a skipped
        step: the next gradient replaces the partition; a lazy one is freed. Not while an
        update is still to read it (one step() left queued under the next forward, Note
        [updates under the next forward]): that update frees it as it ends."""
        pending = self.in_flight.update is not None and not applied
        if self.grad_part is not None and self.ctx.lazy_grads and not pending:
            if self._grad_charged:
                self.ctx.account.credit(self.grad_tier, self.part_numel * 4)
                self._grad_charged = False
            self.grad_part = None
        self.has_grad = False  # the next gradient replaces the partition
