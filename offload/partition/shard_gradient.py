"""A shard's fp32 gradient partition: GradientPartition, one per Shard (shard.gradient).

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

import weakref

import torch

from offload.tiers import Tier


class GradientPartition:
    """One shard's fp32 gradient partition: `part` on `tier`, `pending` while a gradient
    waits for its update. Owned by its Shard (shard.gradient), whose in-flight update it
    waits for before a new gradient goes in."""

    def __init__(self, shard, tier: Tier):
        """shard: its owner, held weakly (no cycle), whose name, context, partition size
        and in-flight update it reads, never copies: offload.init's shards change their
        context and name when the engine takes them over."""
        self._shard = weakref.proxy(shard)
        # Beside the shard's optimizer state (`grad_tier_of`; engine/build.py sets it from the plan).
        self.tier = tier
        self.part: torch.Tensor | None = None
        # Whether `part` is charged to the account: not a staging buffer lent for one
        # update (Note [updates from the staging buffer] in step/gradients.py).
        self._charged = False
        # Whether any gradient arrived since the last optimizer step: like
        # torch.optim, a parameter whose .grad stayed None is not stepped.
        self.pending = False
        # Whether `part` holds this shard group's share only, not yet summed across the
        # groups (Note [gradients across groups once a window] in transfers/grad_buckets.py).
        self.group_share = False

    @property
    def name(self) -> str:
        return self._shard.name

    @property
    def part_numel(self) -> int:
        return self._shard.part_numel

    @property
    def ctx(self):
        return self._shard.ctx

    @property
    def _in_flight(self):
        return self._shard.in_flight

    @property
    def device(self) -> torch.device:
        return self.ctx.device if self.tier is Tier.DEVICE else torch.device("cpu")

    def allocate(self) -> None:
        self.ctx.account.charge(self.tier, self.part_numel * 4, f"gradient of {self.name}")
        self.part = torch.zeros(self.part_numel, dtype=torch.float32, device=self.device)
        self._charged = True

    def take(self, grad: torch.Tensor, owned: bool = False) -> None:
        """Adds this rank's gradient partition, averaged over ranks, into `part` (fp32).
        With one rank that is the whole gradient, any shape; with several, the
        part_numel elements a reduce-scatter gave this rank (Note [gradient buckets]).
        owned: `grad` is autograd's own tensor, which nothing else reuses (else a
        view of a staging buffer or a bucket, copied from)."""
        if self._in_flight.update is not None:  # the update reading the last window's gradient
            self._in_flight.update.result()  # one that raised raises here too
        mine = grad.detach().reshape(-1)
        if mine.numel() < self.part_numel:  # an empty parameter's partition is one padding element
            mine = torch.zeros(self.part_numel, dtype=torch.float32, device=mine.device)
        elif mine.numel() != self.part_numel:
            raise ValueError(f"gradient of {self.name}: {mine.numel()} elements, expected this rank's "
                             f"partition of {self.part_numel}")
        if self.pending:
            self.part.add_(mine.to(self.part.device, torch.float32))
        else:
            # The window's first gradient replaces the partition (no zeroing
            # pass between steps): autograd's own fp32 tensor is taken over;
            # anything else (a view into a staging buffer or a bucket, another
            # dtype) is copied into the partition kept from the last step. A fresh one per step cost a page fault per 4 KiB
            # (879k a step, 2.5 s of system time, GPT 0.94B on a GPU host).
            if self.part is None:
                self.ctx.account.charge(self.tier, self.part_numel * 4, f"gradient of {self.name}")
                self._charged = True
            if (owned and mine.dtype == torch.float32 and mine.device == torch.device(self.device)
                    and mine.is_contiguous() and mine.untyped_storage().nbytes() == self.part_numel * 4):
                self.part = mine
            elif self.part is not None:
                self.part.copy_(mine)
            else:
                self.part = mine.to(self.device, torch.float32, copy=True)
        self.pending = True

    # Note [gradients across groups once a window] (transfers/grad_buckets.py): the three
    # moves of a partition between its group's share and the sum across the groups.
    def fold_into(self, into: torch.Tensor) -> None:
        """Adds the window's sum so far into `into` (this rank's partition of a bucket about
        to be summed across the groups): a group's share from every group, a sum already
        across them from group 0 alone. The result replaces the partition when it comes."""
        if self._in_flight.update is not None:  # the last window's update still reading it
            self._in_flight.update.result()
        if self.pending and (self.group_share or self.ctx.pg.replica == 0):
            into.add_(self.part.to(into.device, torch.float32))
        self.pending = self.group_share = False

    def to_group_share(self) -> None:
        """Before a gradient joins without a sum across the groups: a sum already across
        them stays in group 0's partition only, so that the groups' shares still add up."""
        if self._in_flight.update is not None:
            self._in_flight.update.result()
        if self.pending and not self.group_share and self.ctx.pg.replica > 0:
            self.part.zero_()
        self.group_share = True

    def sum_share_across(self) -> None:
        """The group's share summed across the groups now, in place (a collective: every
        rank calls it for the same shards): before an update, a save, or a read of p.grad
        that the window's last backward did not precede."""
        if not (self.pending and self.group_share):
            return
        on = self.part if self.part.device == self.ctx.device else self.part.to(self.ctx.device)
        self.ctx.pg.sum_across_groups(on)
        if on is not self.part:
            self.part.copy_(on)
        self.group_share = False

    def lend(self, staged: torch.Tensor):
        """For one update from the staging buffer (Note [updates from the staging buffer]
        in step/gradients.py): `staged` is the pending gradient, not charged nor kept;
        returns what to give back to restore()."""
        kept = self.part
        self.part, self.pending = staged, True
        return kept

    def restore(self, kept) -> None:
        """After the lent update: were it not applied (a failed step), the staged gradient
        is copied into a partition of the shard's own, for the retry."""
        staged, self.part = self.part, kept
        if self.pending and staged is not None:
            self.pending = False
            self.take(staged)

    def clear(self, *, applied: bool = False) -> None:
        """After the shard's update (applied: called by the update itself) or a skipped
        step: the next gradient replaces the partition; a lazy one is freed. Not while an
        update is still to read it (one step() left queued under the next forward, Note
        [updates under the next forward]): that update frees it as it ends."""
        pending = self._in_flight.update is not None and not applied
        if self.part is not None and self.ctx.lazy_grads and not pending:
            if self._charged:
                self.ctx.account.credit(self.tier, self.part_numel * 4)
                self._charged = False
            self.part = None
        self.pending = self.group_share = False  # the next gradient replaces the partition
