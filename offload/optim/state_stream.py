"""Reads NVMe optimizer state ahead of the updates that need it.

Each shard's state is one file, [master | exp_avg | exp_avg_sq] in fp32, or
[exp_avg | exp_avg_sq] where the parameter's own fp32 file is the master
(Note [optimizer state tiers] in offload/optim/sharded_adam.py, Note [shared
fp32 master] in offload/optim/states.py); `StateLayout` says which. A stream is
told the order in which updates are expected and keeps reads in flight
ahead of the shard being updated, up to `ahead` times the largest shard's
elements, or `cap_elems` (zero_optimization.sub_group_size) where that is
less; at least one shard is always read ahead. An update out of the expected order (a gradient
that came early, or a shard that was not expected) reads on demand and the
stream continues after it. The buffers are 4096-aligned, so reads and the
writes back go straight between disk and them (Note [direct transfers]).
Writes back stay in flight up to the state bytes of the largest shard in the
order (one write of it at a time, as the memory budget counts): a model of
many small parameters would otherwise wait out each small write's latency
in turn before the next update (GPT 3.3M, updates in step(): 117 -> 104 ms).

All calls come from one thread: the host worker while updates overlap
backward, the compute thread when step() updates, never both at once.

A write that fails is reported by close(), never by a later put() or take():
an update either completes (its write issued, the caller clears the shard's
gradient) or raises before it changed anything, so a failed step can be
retried shard by shard (Note [failed in-place writes] in offload/aio/swap_store.py
keeps the value whose write failed).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from offload.aio.memory import ALIGN, aligned_tensor, round_up
from offload.tiers import Tier


@dataclass(frozen=True)
class StateLayout:
    """Where one shard's master and moments sit in its host buffer.

    Own master: the buffer is the file, [master | exp_avg | exp_avg_sq].
    Shared master: the master comes from the parameter's file into the
    buffer's head, and the moments file lands after it at a 4096-byte
    boundary, so both transfers go straight to disk (Note [direct transfers])."""

    numel: int
    shared_master: bool

    @property
    def moments_at(self) -> int:
        return round_up(self.numel, ALIGN // 4) if self.shared_master else self.numel

    @property
    def buffer_numel(self) -> int:
        return self.moments_at + 2 * self.numel

    def file_part(self, buf: torch.Tensor) -> torch.Tensor:
        """The part of the buffer that the state file holds."""
        return buf[self.moments_at:] if self.shared_master else buf

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, at = self.numel, self.moments_at
        return buf[:n], buf[at:at + n], buf[at + n:at + 2 * n]


class StateStream:
    """layout_of(shard) -> StateLayout. read_master(shard, out) -> a handle: reads a
    shared master from the parameter's file. skip_master: indices of shards whose
    shared master the update brings along (taken from the gathered parameter), so
    the stream does not read it."""

    def __init__(self, store, key_of, order: list, *, account, timeline, ahead: int = 2,
                 cap_elems: int | None = None, buffers=None, layout_of=None, read_master=None,
                 skip_master: frozenset = frozenset()):
        self.store = store
        self._key_of = key_of
        self._layout_of = layout_of or (lambda shard: StateLayout(shard.part_numel, False))
        self._read_master = read_master
        self._skip_master = skip_master
        self._order = order
        self._position = {s.index: i for i, s in enumerate(order)}
        self._account = account
        self._timeline = timeline
        largest = max((sh.part_numel for sh in order), default=1)
        self._budget = min(ahead * largest, cap_elems or float("inf"))
        self._reads: dict[int, tuple[torch.Tensor, list, float]] = {}  # index -> buf, handles, t0
        self._next = 0  # next position in the order to consider reading
        self._writes: deque = deque()  # (handle, nbytes, t0, name) written back, charged until done
        self._writing_bytes = 0
        self._write_cap = max((self._layout_of(s).buffer_numel * 4 for s in order), default=0)
        self._buffers = buffers  # an offload.aio.BufferCache, or None
        self._write_error: BaseException | None = None  # the first, raised by close()

    def layout(self, shard) -> StateLayout:
        return self._layout_of(shard)

    def _start_read(self, shard) -> None:
        layout = self._layout_of(shard)
        numel = layout.buffer_numel
        self._account.charge(Tier.HOST, numel * 4, f"optimizer state buffer of {shard.name}")
        buf = (self._buffers.take(numel, torch.float32) if self._buffers is not None
               else aligned_tensor(numel, torch.float32))
        handles = [self.store.swap_in(self._key_of(shard), out=layout.file_part(buf))]
        if layout.shared_master and shard.index not in self._skip_master:
            handles.append(self._read_master(shard, buf[:layout.numel]))
        self._reads[shard.index] = (buf, handles, time.perf_counter())

    def _top_up(self, after: int) -> None:
        """Starts reads after position `after` while the elements read ahead stay
        within `ahead` of the largest shard (and the cap): counted in elements,
        not shards, so a run of small shards (biases, norms) does not hold back
        the read of the large one after them."""
        self._next = max(self._next, after + 1)
        ahead_elems = sum(self._order[i].part_numel for i in range(after + 1, self._next)
                          if self._order[i].index in self._reads)
        while self._next < len(self._order):
            shard = self._order[self._next]
            if shard.index not in self._reads:
                if ahead_elems and ahead_elems + shard.part_numel > self._budget:
                    return
                self._start_read(shard)
                ahead_elems += shard.part_numel
            self._next += 1

    def start(self) -> None:
        """Starts the first reads before any update is asked for."""
        self._top_up(-1)

    def take(self, shard, master: torch.Tensor | None = None) -> torch.Tensor:
        """The shard's state buffer, read (waiting only if the read is not done).
        master: a shared master's value, when the caller has it (the stream then
        needs no read of it; one it started anyway is overwritten with the same bytes)."""
        if shard.index not in self._reads:
            self._start_read(shard)
        position = self._position.get(shard.index)
        if position is not None:
            self._top_up(position)
        buf, handles, t0 = self._reads.pop(shard.index)
        layout = self._layout_of(shard)
        if layout.shared_master and shard.index in self._skip_master and master is None:
            # Expected from the gathered parameter, which this update did not bring.
            handles.append(self._read_master(shard, buf[:layout.numel]))
        if not all(h.done() for h in handles):
            with self._timeline.span("wait", f"optimizer state {shard.name}"):
                for h in handles:
                    h.wait()
        for h in handles:
            h.wait()  # raises a read error
        if layout.shared_master and master is not None:
            buf[:layout.numel].copy_(master)
        self._timeline.record("read", f"optimizer state {shard.name}", t0)
        return buf

    def put(self, shard, buf: torch.Tensor) -> None:
        """Writes the updated moments (and an own master) back; the buffer is lent until written."""
        nbytes = buf.numel() * 4
        self._writes.append((self.store.swap_out(self._key_of(shard), self._layout_of(shard).file_part(buf),
                                                 borrow=True),
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
            try:
                handle.wait()
            except OSError as exc:  # the store kept the value; close() reports it
                self._write_error = self._write_error or exc
            finally:  # failed or not, the write no longer holds its buffer's bytes
                self._account.credit(Tier.HOST, nbytes)
            self._timeline.record("write", f"optimizer state {name}", t0)

    def close(self) -> None:
        """Waits for every write, and for reads nobody took (their buffers are
        freed); raises the first write error once all of them are waited for,
        so no write is left in flight from a buffer about to be reused."""
        error = self._write_error
        try:
            while self._writes:
                try:
                    self._retire(block=True)
                except Exception as exc:  # noqa: BLE001 - raised below, after the others
                    error = error or exc
            error = error or self._write_error
        finally:
            for buf, handles, _ in self._reads.values():
                for handle in handles:
                    try:
                        handle.wait()
                    except BaseException:  # noqa: BLE001 - a read nobody took: its error (or a
                        pass               # Ctrl-C it recorded, raised already) changes nothing
                self._account.credit(Tier.HOST, buf.numel() * 4)
            self._reads.clear()
        if error is not None:
            raise error
