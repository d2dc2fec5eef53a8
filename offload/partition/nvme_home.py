"""Parameter partitions whose home is NVMe, in compute dtype, one file each.

A thin adapter over offload.aio.SwapStore that speaks in shards: write a
partition, read a parameter back in full onto the device tier. On a CPU-only
host with world size 1 the read lands directly in the device buffer (no
staging copy); otherwise it goes through a host staging tensor, then an
all-gather (several ranks) or a host-to-device copy (CUDA).
"""
from __future__ import annotations

import torch



def _key(shard) -> str:
    return f"param.{shard.index}"


class _PendingRead:
    def __init__(self, handle, finish):
        self._handle, self._finish = handle, finish

    def wait(self):
        self._handle.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None


class ParamStore:
    def __init__(self, store, pg):
        self.store = store  # an offload.aio.SwapStore, possibly shared with optimizer state
        self.pg = pg

    def write(self, shard, part: torch.Tensor):
        """Writes this rank's partition (compute dtype, host) asynchronously."""
        return self.store.swap_out(_key(shard), part)

    def read_part(self, shard, out: torch.Tensor):
        """Starts reading this rank's partition into `out` (host, part_numel elements)."""
        return self.store.swap_in(_key(shard), out=out)

    def read_full(self, shard, full: torch.Tensor) -> _PendingRead:
        """Starts filling `full` (padded flat, device tier) with the parameter."""
        direct = self.pg.world_size == 1 and full.device.type == "cpu"
        if direct:
            handle = self.store.swap_in(_key(shard), out=full[:shard.part_numel])
            return _PendingRead(handle, None)
        staging = torch.empty(shard.part_numel, dtype=shard.dtype,
                              pin_memory=torch.cuda.is_available())
        handle = self.store.swap_in(_key(shard), out=staging)
        return _PendingRead(handle, lambda: self.pg.all_gather(full, staging))

    def close(self) -> None:
        self.store.close()

    def path_of(self, shard):
        """The swap file of `shard`'s partition (checkpoints copy it)."""
        return self.store.path_of(_key(shard))
