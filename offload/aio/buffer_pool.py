"""Host staging buffers for the swap store, bounded by a byte budget.

Why a budget and not a count of fixed-size buffers: DeepSpeed's swapper is
configured with a buffer count and size by hand, and fails mid-run with "Not
enough buffers" or "More elements than buffer size". Here the pool only
promises that the bytes it hands out never exceed `budget_bytes`; the store
splits anything larger than the budget into pieces, and when the budget is in
use it waits for the oldest transfer to finish (backpressure) instead of
failing. Buffers are 4096-aligned (O_DIRECT without a staging copy) and
pinned when CUDA exists; freed buffers are kept for reuse and dropped only
when a new size needs the room.

Every allocation is host memory the process holds whether a transfer is in
flight or not, so an optional ledger (anything with charge(nbytes, what) and
credit(nbytes); the engine passes its host tier) is charged a buffer's size
when it is made and credited when the pool drops it: the same bytes the
budget counts, so a budget checked at initialize holds mid-step. (Each
allocation also carries up to one alignment unit of padding, not counted.)
"""
from __future__ import annotations

import torch

from offload.aio.memory import ALIGN, aligned_empty, round_up


class BufferPool:
    def __init__(self, budget_bytes: int, pin: bool | None = None, ledger=None):
        if budget_bytes < 2 * ALIGN:
            raise ValueError(f"buffer budget must be at least {2 * ALIGN} bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._pin = pin
        self._ledger = ledger
        self._free: list[torch.Tensor] = []  # cached, whole allocations
        self.allocated_bytes = 0  # held by callers plus cached
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def try_acquire(self, nbytes: int) -> torch.Tensor | None:
        """An aligned uint8 buffer of at least `nbytes` (sliced to nbytes), or
        None while the budget is held by buffers in use."""
        size = round_up(max(nbytes, 1))
        if size > self.budget_bytes:
            raise ValueError(f"request of {size} bytes exceeds the pool budget of {self.budget_bytes}")
        # Best fit among cached buffers that are not wastefully large.
        fits = [b for b in self._free if size <= b.numel() <= 2 * size]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            self._take(buf)
        else:
            while self.allocated_bytes + size > self.budget_bytes and self._free:
                victim = max(self._free, key=torch.Tensor.numel)
                self._take(victim)
                self._drop(victim)
            if self.allocated_bytes + size > self.budget_bytes:
                return None
            if self._ledger is not None:  # before allocating: a refused charge leaves nothing held
                self._ledger.charge(size, "swap staging buffer")
            try:
                buf = aligned_empty(size, pin=self._pin)
            except BaseException:
                if self._ledger is not None:
                    self._ledger.credit(size)
                raise
            self.allocated_bytes += size
        self.in_use_bytes += buf.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def _take(self, buf: torch.Tensor) -> None:
        # By identity: list.remove would compare tensors elementwise.
        del self._free[next(i for i, b in enumerate(self._free) if b is buf)]

    def release(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel()
        self._free.append(buf)

    def clear(self) -> None:
        for buf in self._free:
            self._drop(buf)
        self._free.clear()

    def _drop(self, buf: torch.Tensor) -> None:
        self.allocated_bytes -= buf.numel()
        if self._ledger is not None:
            self._ledger.credit(buf.numel())
