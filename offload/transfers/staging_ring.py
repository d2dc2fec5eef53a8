"""One pinned slab, handed out as a ring: the gradients on their way device->host.

Note [gradient staging ring]
Each gradient's device->host copy lands in pinned host memory, where the
host worker takes it in (Note [copy streams] in device_copies.py). While
the slab is full, backward waits for the worker. A pool of fixed buffers,
each the size of the largest gradient, held four gradients whatever their
size: GPT 0.94B, whose embedding is five times a block's largest matrix,
had backward wait on the fifth gradient, so backward ran at the host Adam's
pace (an H200 host in bf16: 0.387 s for 0.065 s of compute). The same bytes
cut to each gradient's size hold a block's worth of gradients many times
over, so backward runs ahead of the updates by that much. Gradients are
taken in (and released) mostly in the order they came, so a ring: new ones
go after the newest, wrapping to the start where the oldest has gone; one
released out of turn (Note [head first after backward] in device_copies.py)
frees its bytes once those before it are free too. The slab is made at
initialize, one allocation pinned once; a memory.pinned_budget too small
for it fails there.
"""
from __future__ import annotations

import threading
from collections import deque

import torch

from offload.aio.buffer_pool import boxed
from offload.aio.memory import aligned_empty, round_up


class StagingRing:
    """`capacity` bytes of (pinned) host memory, each acquire a contiguous aligned piece."""

    def __init__(self, capacity: int, *, pin: bool, ledger=None, layer=None, what: str):
        """layer: the device layer the slab is registered with as pinned memory, each
        piece handed out tracked on its own (DeviceLayer.pinned_piece)."""
        self.capacity = round_up(max(capacity, 1))
        self._what = what
        self._ledger = ledger
        if ledger is not None:  # before allocating: a refused charge leaves nothing held
            ledger.charge(self.capacity, what)
        try:
            self._slab = aligned_empty(self.capacity, pin=pin)
            if layer is not None:
                layer.register_pinned(self._slab, what)  # counted; the pieces are what copies see
        except BaseException:
            if ledger is not None:
                ledger.credit(self.capacity)
            raise
        self._layer = layer
        self._base = self._slab.data_ptr()
        self._pieces: deque[list] = deque()  # [offset, size, released], oldest first
        self._cond = threading.Condition()
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.closed = False

    def acquire(self, nbytes: int, timeout: float = 600.0) -> torch.Tensor:
        """A uint8 view of at least `nbytes`, waiting while the ring has no room for it;
        a wait past `timeout` seconds is an error naming the ring."""
        size = round_up(max(nbytes, 1))
        if size > self.capacity:
            raise ValueError(f"{self._what}: request of {size} bytes exceeds its {self.capacity} bytes")
        with self._cond:
            placed = self._cond.wait_for(lambda: boxed(self._place(size)), timeout)
            if placed is None:
                raise TimeoutError(f"{self._what}: no room for {size} bytes came free in {timeout:.0f} s "
                                   f"({self.in_use_bytes} of {self.capacity} bytes in use)")
            (offset,) = placed
            self._pieces.append([offset, size, False])
            self.in_use_bytes += size
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            piece = self._slab[offset:offset + size]
        return piece if self._layer is None else self._layer.pinned_piece(piece, self._what)

    def _place(self, size: int) -> int | None:
        if self.closed:
            raise RuntimeError(f"{self._what}: the ring is closed")
        if not self._pieces:
            return 0
        tail = self._pieces[0][0]
        newest = self._pieces[-1]
        head = newest[0] + newest[1]
        if head > tail:  # not wrapped: room after the newest, else at the start
            if self.capacity - head >= size:
                return head
            return 0 if tail >= size else None  # wrap to the start, before the oldest
        return head if tail - head >= size else None  # wrapped: the room up to the oldest

    def release(self, buf: torch.Tensor) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # a piece the sim tracks is a subclass
            offset = buf.data_ptr() - self._base
        with self._cond:
            piece = next((p for p in self._pieces if p[0] == offset and not p[2]), None)
            if piece is None:
                raise ValueError(f"{self._what}: released a buffer it did not hand out (offset {offset})")
            piece[2] = True
            self.in_use_bytes -= piece[1]
            while self._pieces and self._pieces[0][2]:
                self._pieces.popleft()
            self._cond.notify_all()

    def close(self) -> None:
        """Gives the slab back (its charge credited). Idempotent; call once nothing is in flight."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._pieces.clear()
            self._cond.notify_all()
        self._slab = None
        if self._ledger is not None:
            self._ledger.credit(self.capacity)
