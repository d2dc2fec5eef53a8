"""Reads NVMe optimizer state ahead of the updates that need it.

Each shard's state is one file, [master | exp_avg | exp_avg_sq] in fp32
(Note [optimizer state tiers] in offload/optim/sharded_adam.py). A stream is
told the order in which updates are expected and keeps the reads of the next
`ahead` shards in flight while one is updated, fewer where that would put
more than `cap_elems` elements (zero_optimization.sub_group_size) in buffers
ahead of the current one. An update out of the expected order (a gradient
that came early, or a shard that was not expected) reads on demand and the
stream continues after it. The buffers are 4096-aligned, so reads and the
writes back go straight between disk and them (Note [direct transfers]).
Writes back stay in flight up to the state bytes of the largest shard in the
order (one write of it at a time, as the memory budget counts): a model of
many small parameters would otherwise wait out each small write's latency
in turn before the next update (GPT 3.3M, deferred step: 117 -> 104 ms).

All calls come from one thread: the optimizer thread while updates overlap
backward, the compute thread in a deferred step, never both at once.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from offload.aio._memory import aligned_tensor
from offload.partition.accounting import Tier


class StateStream:
    def __init__(self, store, key_of, order: list, *, account, timeline, ahead: int = 2,
                 cap_elems: int | None = None, buffers=None):
        self.store = store
        self._key_of = key_of
        self._order = order
        self._position = {s.index: i for i, s in enumerate(order)}
        self._account = account
        self._timeline = timeline
        self._ahead = ahead
        self._cap = cap_elems if cap_elems else float("inf")
        self._reads: dict[int, tuple[torch.Tensor, object, float]] = {}  # index -> buf, handle, t0
        self._next = 0  # next position in the order to consider reading
        self._writes: deque = deque()  # (handle, nbytes, t0, name) written back, charged until done
        self._writing_bytes = 0
        self._write_cap = max((3 * s.part_numel * 4 for s in order), default=0)
        self._buffers = buffers  # an offload.aio.BufferCache, or None

    def _start_read(self, shard) -> None:
        nbytes = 3 * shard.part_numel * 4
        self._account.charge(Tier.HOST, nbytes, f"optimizer state buffer of {shard.name}")
        buf = (self._buffers.take(3 * shard.part_numel, torch.float32) if self._buffers is not None
               else aligned_tensor(3 * shard.part_numel, torch.float32))
        self._reads[shard.index] = (buf, self.store.swap_in(self._key_of(shard), out=buf),
                                    time.perf_counter())

    def _top_up(self, after: int) -> None:
        """Starts reads for up to `ahead` shards after position `after`."""
        self._next = max(self._next, after + 1)
        ahead_elems = sum(self._order[i].part_numel for i in range(after + 1, self._next)
                          if self._order[i].index in self._reads)
        while self._next < len(self._order) and self._next <= after + self._ahead:
            shard = self._order[self._next]
            if shard.index not in self._reads:
                if ahead_elems and ahead_elems + shard.part_numel > self._cap:
                    return
                self._start_read(shard)
                ahead_elems += shard.part_numel
            self._next += 1

    def start(self) -> None:
        """Starts the first reads before any update is asked for."""
        self._top_up(-1)

    def take(self, shard) -> torch.Tensor:
        """The shard's state buffer, read (waiting only if the read is not done)."""
        if shard.index not in self._reads:
            self._start_read(shard)
        position = self._position.get(shard.index)
        if position is not None:
            self._top_up(position)
        buf, handle, t0 = self._reads.pop(shard.index)
        if not handle.done():
            with self._timeline.span("wait", f"optimizer state {shard.name}"):
                handle.wait()
        handle.wait()  # raises a read error
        self._timeline.record("read", f"optimizer state {shard.name}", t0)
        return buf

    def put(self, shard, buf: torch.Tensor) -> None:
        """Writes the updated state back; the buffer is lent until written."""
        nbytes = buf.numel() * 4
        self._writes.append((self.store.swap_out(self._key_of(shard), buf, borrow=True),
                             nbytes, time.perf_counter(), shard.name))
        self._writing_bytes += nbytes
        if self._buffers is not None:
            self._buffers.give(buf)  # reused once the write no longer holds it
        self._retire(block=False)

    def _retire(self, block: bool) -> None:
        # Writes in flight are bounded by bytes (their buffers are host memory
        # too): the newest alone may be the largest; older ones finish while
        # the next shard is read and updated.
        while self._writes and (block or self._writes[0][0].done()
                                or (len(self._writes) > 1 and self._writing_bytes > self._write_cap)):
            handle, nbytes, t0, name = self._writes.popleft()
            self._writing_bytes -= nbytes
            handle.wait()
            self._timeline.record("write", f"optimizer state {name}", t0)
            self._account.credit(Tier.HOST, nbytes)

    def close(self) -> None:
        """Waits for every write, and for reads nobody took (their buffers are freed)."""
        try:
            self._retire(block=True)
        finally:
            for buf, handle, _ in self._reads.values():
                try:
                    handle.wait()
                except BaseException:  # noqa: BLE001 - a read nobody took: its error (or a
                    pass               # Ctrl-C it recorded, raised already) changes nothing
                finally:
                    self._account.credit(Tier.HOST, buf.numel() * 4)
            self._reads.clear()
