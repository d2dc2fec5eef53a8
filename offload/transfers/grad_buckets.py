"""Gradients of several ranks, reduce-scattered in buckets.

Note [gradient buckets]
With several ranks each rank keeps only its partition of a gradient (Note
[shard layout]), so a gradient is reduce-scattered: every rank sends its full
gradient and receives the sum of its own partition, (W-1)/W of the bytes per
rank on a ring, half of what an all_reduce followed by a slice sends. Small
gradients (biases, norms) would each cost a collective's latency, so they
are packed: a gradient arriving in backward (the manager's post-accumulate-
grad hook) joins the open bucket, and the bucket is sent when the next
gradient would take it past `zero_optimization.reduce_bucket_size` elements
(counted as padded full gradients), when it is full, and at the end of each
backward (the manager's autograd callback). A gradient larger than a bucket
goes alone. Buckets are filled in autograd's order, which is the same on
every rank, so every rank issues the same collectives in the same order.

The bucket is laid out rank-major, (W, sum of the partitions): row r holds
every gradient's partition r, zero-padded, so the reduce-scatter hands rank r
exactly its partitions, one after the other. It is fp32 (the sum over ranks
in the gradients' dtype would round at every add), allocated when sent and
freed after: the gradients it packs are held until then, so the bytes in
flight are one bucket of gradients plus its fp32 copy. The mean is the sum
divided by W, element by element as the all_reduce it replaces did; with two
ranks a sum of two values does not depend on order, so it is bit for bit the
same (tests/engine/test_reduce_scatter.py).

With one rank there are no buckets: the gradient reaches the shard directly
(Note [gradient partitions] in partition/shard.py), no copy made.

Note [gradients across groups once a window]
With several shard groups (Note [hybrid sharding] in transfers/layout.py) a
bucket is reduce-scattered within the group at every backward, but summed
across the groups only at the accumulation window's last backward (the
step's `at_boundary`). Before it, each partition accumulates its group's
share of the mean (GradientPartition.group_share). At it, the bucket takes
in each partition's sum so far (`fold`), the one all_reduce across the groups
runs, and its result replaces the partitions. The slow link then carries the
gradients once an optimizer step, not once a micro-step; the sum is the same,
in another order. A partition may also hold a sum already across the groups
(a loop that accumulates over several windows of one, a checkpoint loaded
inside a window): group 0 alone brings that into a fold, and before a share
joins it the other groups zero their copy (`share`), so the shares always
add up to the whole. Where a share is still pending when it is needed, it is
summed across the groups there: before an update that no window's end
preceded (a loop stepping the optimizer itself) and before a checkpoint saves
it (group 0 saves the whole); p.grad refuses it.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from offload.transfers.collectives import ProcessGroupInfo


class _Partitioned(Protocol):
    numel: int
    part_numel: int
    padded_numel: int


class GradientBuckets:
    def __init__(self, pg: ProcessGroupInfo, bucket_elems: int,
                 deliver: Callable[[_Partitioned, torch.Tensor], None], *,
                 window_ends: Callable[[], bool] = lambda: True,
                 fold: Callable[[_Partitioned, torch.Tensor], None] | None = None,
                 share: Callable[[_Partitioned], None] | None = None):
        """bucket_elems: padded full-gradient elements per bucket (at least 1).
        deliver(shard, part): this rank's averaged fp32 partition of the shard's
        gradient (a view into the bucket's output, valid during the call).
        window_ends(): whether this backward ends the accumulation window; fold(shard,
        into): adds the shard's pending sum into `into` and lets the next gradient
        replace it; share(shard): the next gradient is its group's share only (Note
        [gradients across groups once a window])."""
        if pg.job_size < 2:
            raise ValueError("gradient buckets are for several ranks; with one the gradient goes "
                             "straight to its shard (Note [gradient buckets])")
        self.pg = pg
        self.bucket_elems = max(1, int(bucket_elems))
        self._deliver = deliver
        self._window_ends, self._fold, self._share = window_ends, fold, share
        self._pending: list[tuple[_Partitioned, torch.Tensor]] = []
        self._pending_elems = 0
        self.buckets_sent = 0

    @classmethod
    def for_shards(cls, pg: ProcessGroupInfo, shards: list, bucket_elems: int | None, deliver, hooks):
        """The buckets of a manager's shards: bucket_elems None, the largest padded parameter."""
        largest = max(s.padded_numel for s in shards)
        return cls(pg, bucket_elems or largest, deliver, window_ends=hooks.at_boundary,
                   fold=lambda shard, into: shard.gradient.fold_into(into),
                   share=lambda shard: shard.gradient.to_group_share())

    def add(self, shard: _Partitioned, grad: torch.Tensor) -> None:
        """Packs one full gradient; sends the bucket when it fills."""
        if self._pending and self._pending_elems + shard.padded_numel > self.bucket_elems:
            self.flush()
        self._pending.append((shard, grad.detach()))
        self._pending_elems += shard.padded_numel
        if self._pending_elems >= self.bucket_elems:
            self.flush()

    def flush(self) -> None:
        """Sends the open bucket (the end of a backward); nothing when it is empty."""
        if not self._pending:
            return
        pending, self._pending, self._pending_elems = self._pending, [], 0
        world = self.pg.world_size
        per_rank = sum(shard.part_numel for shard, _ in pending)
        device = pending[0][1].device
        bucket = torch.empty(world, per_rank, dtype=torch.float32, device=device)
        start = 0
        for shard, grad in pending:
            _place(bucket[:, start:start + shard.part_numel], grad.reshape(-1))
            start += shard.part_numel
        shards = [shard for shard, _ in pending]
        del pending, grad  # autograd's gradients are free once packed
        mine = torch.empty(per_rank, dtype=torch.float32, device=device)
        across = self.pg.replicas == 1 or self._window_ends()
        self.pg.reduce_scatter_mean(mine, bucket)
        del bucket
        if self.pg.replicas > 1:  # Note [gradients across groups once a window]
            start = 0
            for shard in shards:
                if across and self._fold is not None:
                    self._fold(shard, mine[start:start + shard.part_numel])
                elif not across and self._share is not None:
                    self._share(shard)
                start += shard.part_numel
            if across:
                self.pg.sum_across_groups(mine)
        self.buckets_sent += 1
        start = 0
        for shard in shards:
            self._deliver(shard, mine[start:start + shard.part_numel])
            start += shard.part_numel

    def discard(self) -> None:
        """Drops the open bucket without a collective (a backward that raised:
        the other ranks may never send theirs)."""
        self._pending, self._pending_elems = [], 0


def _place(columns: torch.Tensor, flat: torch.Tensor) -> None:
    """columns (W, part) <- flat laid out over the rows in order, zero-padded
    (row r is partition r: Note [shard layout] in partition/shard.py)."""
    part = columns.shape[1]
    whole_rows = flat.numel() // part
    columns[:whole_rows].copy_(flat[:whole_rows * part].view(whole_rows, part))
    if whole_rows < columns.shape[0]:
        rest = flat.numel() - whole_rows * part
        columns[whole_rows, :rest].copy_(flat[whole_rows * part:])
        columns[whole_rows, rest:].zero_()
        columns[whole_rows + 1:].zero_()
