"""Parameter partitions whose home is NVMe, in compute dtype, one file each.

A thin adapter over offload.aio.SwapStore that speaks in shards: write a
partition, read a parameter back in full onto the device tier. On a CPU-only
host with world size 1 the read lands directly in the device buffer (no
staging copy); otherwise it goes through a host staging tensor, then an
all-gather (several ranks) or a host-to-device copy (CUDA).
"""
from __future__ import annotations

import time

import torch

from offload.aio.memory import aligned_tensor
from offload.aio.swap_store import SwapStore
from offload.partition.collectives import ProcessGroupInfo
from offload.timeline import Timeline


def _key(shard) -> str:
    return f"param.{shard.index}"


class _PendingRead:
    def __init__(self, handle, finish, timeline, name: str):
        self._handle, self._finish = handle, finish
        self._timeline, self._name = timeline, name
        self._t0 = time.perf_counter()
        self._done = False

    def _wait_bytes(self):
        if not self._done:
            self._handle.wait()
            self._done = True
            if self._timeline is not None:
                self._timeline.record("read", self._name, self._t0)

    def wait(self):
        self._wait_bytes()
        if self._finish is not None:
            self._finish()
            self._finish = None

    def cancel(self):
        """Waits for the bytes (the buffer must not be freed under the kernel)
        but skips the all-gather: a prefetch nobody used, whose errors do not matter."""
        self._finish = None
        try:
            self._wait_bytes()
        except Exception:  # noqa: BLE001 - the value is being thrown away
            self._done = True


class ParamStore:
    """The shards' offload.partition.shard.PartitionStore over NVMe files.

    store: the SwapStore one thread uses (Note [one store per thread] in
    offload/engine/build.py); the compute thread reads, the optimizer writes.
    timeline: where the reads are recorded (the engine's), or None."""

    def __init__(self, store: SwapStore, pg: ProcessGroupInfo, timeline: Timeline | None = None):
        self.store = store
        self.pg = pg
        self.timeline = timeline

    def write(self, shard, part: torch.Tensor, *, borrow: bool = False):
        """Writes this rank's partition (compute dtype, host) asynchronously;
        borrow=True: `part` stays unchanged until the write is finished."""
        return self.store.swap_out(_key(shard), part, borrow=borrow)

    def read_part(self, shard, out: torch.Tensor):
        """Starts reading this rank's partition into `out` (host, part_numel elements)."""
        return self.store.swap_in(_key(shard), out=out)

    def read_full(self, shard, full: torch.Tensor) -> _PendingRead:
        """Starts filling `full` (padded flat, device tier) with the parameter."""
        direct = self.pg.world_size == 1 and full.device.type == "cpu"
        if direct:
            handle = self.store.swap_in(_key(shard), out=full[:shard.part_numel])
            return _PendingRead(handle, None, self.timeline, shard.name)
        staging = aligned_tensor(shard.part_numel, shard.dtype)  # pinned when CUDA exists
        handle = self.store.swap_in(_key(shard), out=staging)
        return _PendingRead(handle, lambda: self.pg.all_gather(full, staging), self.timeline, shard.name)

    def close(self) -> None:
        self.store.close()

    def path_of(self, shard):
        """The swap file of `shard`'s partition (checkpoints copy it)."""
        return self.store.path_of(_key(shard))
