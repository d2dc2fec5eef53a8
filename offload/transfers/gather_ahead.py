"""Several parameters all-gathered ahead of their use in one collective (Note
[all-gathers ahead] in partition/prefetch.py).

The parameters a use names together (`PrefetchScheduler.gathers_ahead`) are
packed: each rank's partitions side by side in one input, one all-gather,
and the output, laid out rank by rank, (world, sum of the partitions), is
copied out into each parameter's buffer when the first of them is used. So
the bias and norm weights that follow a matrix cost one collective's latency
between them, not one each. The packed buffers are device memory of the
layer, charged to the device tier while they live.
"""
from __future__ import annotations

from offload.tiers import Tier


def start_all_gather_ahead(shards: list) -> None:
    """Starts one all-gather of `shards` (each ready: Shard.ready_to_gather_ahead)."""
    packed = PackedAllGather(shards)
    for shard in shards:
        shard.in_flight.all_gather = packed


class PackedAllGather:
    def __init__(self, shards: list):
        ctx = shards[0].ctx
        self.shards = shards
        self._layer, self._account = ctx.layer, ctx.account
        self._world = ctx.pg.world_size
        self._offsets, total = [], 0
        for shard in shards:
            self._offsets.append(total)
            total += shard.part_numel
        self._per_rank = total
        dtype = shards[0].dtype
        self._nbytes = (self._world + 1) * total * dtype.itemsize
        self._account.charge(Tier.DEVICE, self._nbytes, "parameters all-gathered ahead")
        self._input = self._layer.alloc(total, dtype, "packed all-gather input")
        self._output = self._layer.alloc(self._world * total, dtype, "packed all-gather output")
        packed = self._layer.lend(self._input, write=True)
        for shard, offset in zip(shards, self._offsets):
            own = shard.own_slice(self._layer.lend(shard.full_buffer(), write=False))
            packed[offset:offset + shard.part_numel].copy_(own)
        self._work = ctx.pg.all_gather_async(self._layer.lend(self._output, write=True), packed)
        self._packed = packed  # unchanged until the collective is over
        self.done = False

    def finish(self) -> None:
        """Waits the collective and copies every parameter's value out (once)."""
        if self.done:
            return
        self.done = True
        self._work.wait()  # compute-after-all-gather
        out = self._layer.lend(self._output, write=False).view(self._world, self._per_rank)
        for shard, offset in zip(self.shards, self._offsets):
            full = self._layer.lend(shard.full_buffer(), write=True).view(self._world, shard.part_numel)
            full.copy_(out[:, offset:offset + shard.part_numel])
        self._packed = None
        self._layer.free(self._input)
        self._layer.free(self._output)
        self._account.credit(Tier.DEVICE, self._nbytes)
