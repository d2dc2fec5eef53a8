"""Parameter partitions whose home is NVMe, in compute dtype, one file each.

A thin adapter over offload.aio.SwapStore that speaks in shards: write a
partition, read a parameter back in full onto the device tier. On a CPU-only
host with world size 1 the read lands directly in the device buffer (no
staging copy); otherwise it goes through a buffer of the staging pool (Note
[staging pool] in offload/aio/buffer_pool.py), then an all-gather (several
ranks, CPU-only) or a copy-in on the h2d stream (a device with memory of its
own; the shard all-gathers after it, Note [copy streams] in device_copies.py).
A staging buffer goes back to the pool only once its copy-in has completed
(`_after_copy_in`, the wait staging-after-h2d).

Note [staging buffers for reads ahead]
Only the compute thread reads parameters, so a read waiting for a staging
buffer would wait for itself: the prefetcher's reads ahead hold buffers
until the step takes their parameters into use. So a read takes a buffer
only while one more stays free (`keep_free_bytes`), and when none is, it is
put off (`_DeferredRead`) and started when the step waits on it: the step's
own read always finds the buffer kept free, and the pool never grows.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from offload.aio.buffer_pool import BufferPool
from offload.aio.memory import aligned_tensor
from offload.aio.swap_store import SwapStore
from offload.transfers.collectives import ProcessGroupInfo
from offload.transfers.device_copies import waits
from offload.timeline import Timeline


MIN_STAGING_DEPTH = 2  # one read ahead, and the one the step waits on


def _key(shard) -> str:
    return f"param.{shard.index}"


def stages_reads(world_size: int, separate_memory: bool) -> bool:
    """Whether a parameter read goes through a staging buffer: unless one rank
    on a CPU-only host, where the device buffer itself is host memory."""
    return world_size > 1 or separate_memory


def staging_depth(padded: list[int], bucket_elems: int) -> int:
    """Buffers of the staging pool: the one the step waits on, plus the reads
    the prefetcher keeps ahead (its bucket in units of the largest parameter,
    plus the one it always reads past the bucket; none with prefetch off),
    never more than the parameters read. `padded`: the NVMe parameters'
    padded elements."""
    ahead = 0 if bucket_elems <= 0 else -(-bucket_elems // max(padded)) + 1
    return max(MIN_STAGING_DEPTH, min(len(padded), 1 + ahead))


class _PendingRead:
    def __init__(self, handle, finish, timeline, name: str, release=None):
        self._handle, self._finish = handle, finish
        self._timeline, self._name = timeline, name
        self._release = release  # gives the staging buffer back, once the bytes are done with
        self._t0 = time.perf_counter()
        self._done = False

    def _wait_bytes(self):
        if not self._done:
            try:
                self._handle.wait()
            except Exception:
                self._done = True  # the transfer is over, failed: its buffer is free again
                raise
            self._done = True
            if self._timeline is not None:
                self._timeline.record("read", self._name, self._t0)

    def bytes_ready(self) -> bool:
        """Whether the bytes are in (wait() would not block on the disk)."""
        return self._done or self._handle.done()

    def wait(self):
        """Returns what the finish returned: the copy-in's event on a separate device."""
        result = None
        try:
            self._wait_bytes()
            if self._finish is not None:
                result = self._finish()  # an all-gather, or a copy-in started, out of the staging buffer
                self._finish = None
        finally:
            self._give_back(result)
        return result

    def cancel(self):
        """Waits for the bytes (the buffer must not be freed under the kernel)
        but skips the all-gather: a prefetch nobody used, whose errors do not matter."""
        self._finish = None
        try:
            self._wait_bytes()
        except Exception:  # noqa: BLE001 - the value is being thrown away
            self._done = True
        self._give_back()

    def _give_back(self, copy_in=None):
        if self._release is not None and self._done:
            self._release(copy_in)
            self._release = None


class _DeferredRead:
    """A read put off for want of a free staging buffer (Note [staging buffers
    for reads ahead]): started, and waited for, when the step needs it."""

    def __init__(self, start):
        self._start = start

    def wait(self):
        return self._start().wait()

    def bytes_ready(self) -> bool:
        return False  # not started

    def cancel(self):
        pass


class ParamStore:
    """The shards' offload.partition.shard.PartitionStore over NVMe files.

    store: the SwapStore one thread uses (Note [one store per thread] in
    offload/engine/stores.py); the compute thread reads, the optimizer writes.
    timeline: where the reads are recorded (the engine's), or None.
    staging: the staging pool (Note [staging pool]) of buffers of the largest
    partition; None: a fresh aligned tensor per staged read (offload.init)."""

    def __init__(self, store: SwapStore, pg: ProcessGroupInfo, timeline: Timeline | None = None,
                 staging: BufferPool | None = None):
        self.store = store
        self.pg = pg
        self.timeline = timeline
        self.staging = staging
        self._after_copy_in: deque = deque()  # (event, buffer): staging buffers a copy-in still reads

    def write(self, shard, part: torch.Tensor, *, borrow: bool = False):
        """Writes this rank's partition (compute dtype, host) asynchronously;
        borrow=True: `part` stays unchanged until the write is finished."""
        return self.store.swap_out(_key(shard), part, borrow=borrow)

    def read_part(self, shard, out: torch.Tensor):
        """Starts reading this rank's partition into `out` (host, part_numel elements)."""
        return self.store.swap_in(_key(shard), out=out)

    def read_full(self, shard, full: torch.Tensor) -> _PendingRead:
        """Starts filling `full` (padded flat, device tier) with the parameter; on a
        separate device, wait() returns the event of its copy-in (Note [copy streams])."""
        streams = shard.ctx.streams
        if not stages_reads(self.pg.world_size, streams is not None):
            handle = self.store.swap_in(_key(shard), out=full[:shard.part_numel])
            return _PendingRead(handle, None, self.timeline, shard.name)
        if self.staging is None:
            staging = aligned_tensor(shard.part_numel, shard.dtype)
            handle = self.store.swap_in(_key(shard), out=staging)
            if streams is not None:  # pageable: the layer copies it synchronously
                finish = lambda: streams.to_device(shard.own_slice(full), staging)  # noqa: E731
            else:
                finish = lambda: self.pg.all_gather(full, staging)  # noqa: E731
            return _PendingRead(handle, finish, self.timeline, shard.name)
        nbytes = shard.part_numel * shard.dtype.itemsize
        self._reclaim(wait=False)
        buf = self.staging.try_acquire(nbytes, keep_free_bytes=self.staging.buffer_bytes)
        if buf is None:
            return _DeferredRead(lambda: self._read_staged(shard, full, self._acquire(nbytes)))
        return self._read_staged(shard, full, buf)

    def _acquire(self, nbytes: int) -> torch.Tensor:
        """A staging buffer for the read the step waits on (Note [staging buffers for reads ahead])."""
        buf = self.staging.try_acquire(nbytes)
        while buf is None and self._after_copy_in:
            self._reclaim(wait=True, oldest_only=True)
            buf = self.staging.try_acquire(nbytes)
        return buf if buf is not None else self.staging.acquire(nbytes)

    def _read_staged(self, shard, full: torch.Tensor, buf: torch.Tensor) -> _PendingRead:
        streams = shard.ctx.streams
        # The read writes the buffer from the host: ordered after the copy-in that last read it.
        target = buf if streams is None else streams.layer.lend(buf, write=True)
        staging = target[:shard.part_numel * shard.dtype.itemsize].view(shard.dtype)
        try:
            handle = self.store.swap_in(_key(shard), out=staging)
        except BaseException:
            self.staging.release(buf)
            raise
        if streams is None:
            finish = lambda: self.pg.all_gather(full, staging)  # noqa: E731
        else:
            source = buf[:shard.part_numel * shard.dtype.itemsize].view(shard.dtype)
            finish = lambda: streams.to_device(shard.own_slice(full), source)  # noqa: E731
        return _PendingRead(handle, finish, self.timeline, shard.name,
                            release=lambda copy_in: self._release_after(copy_in, buf))

    def _release_after(self, copy_in, buf: torch.Tensor) -> None:
        if copy_in is None or not waits("staging-after-h2d"):
            self.staging.release(buf)
        else:
            self._after_copy_in.append((copy_in, buf))  # staging-after-h2d (Note [copy streams])

    def _reclaim(self, *, wait: bool, oldest_only: bool = False) -> None:
        """Gives back the staging buffers whose copy-in has completed (wait: the oldest
        first, waiting for it)."""
        while self._after_copy_in:
            event, buf = self._after_copy_in[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self._after_copy_in.popleft()
            self.staging.release(buf)
            if oldest_only:
                return

    def close(self) -> None:
        while self._after_copy_in:
            self._reclaim(wait=True)
        self.store.close()
        if self.staging is not None:
            self.staging.close()  # credits its bytes; the buffers go with the last reference

    def path_of(self, shard):
        """The swap file of `shard`'s partition (checkpoints copy it)."""
        return self.store.path_of(_key(shard))
