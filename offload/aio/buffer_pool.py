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

Note [staging pool]
The same pool, with `buffer_bytes` set, is the engine's pool of host staging
buffers between NVMe and the device (offload/transfers/nvme_home.py
ParamStore): every buffer is exactly `buffer_bytes` (the largest transfer),
so a budget of depth x buffer_bytes makes at most `depth` buffers, each
allocated (and pinned, with CUDA and pin_memory) at initialize (`fill`)
and reused for the rest of the run: no allocation and no pinning per
transfer after the first step. `acquire` waits for a buffer another thread
releases; `allocations` counts the buffers made (tests check it stays put).
The engine's close() closes it (`close`): every buffer and its charge go.
"""
from __future__ import annotations

import threading

import torch

from offload.accounting import TierBudgetError, TierUsage
from offload.aio.memory import ALIGN, aligned_empty, round_up


def boxed(value):
    """None, or `value` in a tuple: a result Condition.wait_for can tell from a timeout
    (a tensor has no truth value)."""
    return None if value is None else (value,)


class BufferPool:
    def __init__(self, budget_bytes: int, pin: bool | None = None, ledger=None, *,
                 buffer_bytes: int | None = None, what: str = "swap staging buffer", register=None):
        """register(buf, what) -> buf: applied to each buffer made (a device layer's
        register_pinned, so host<->device copies out of the pool are asynchronous)."""
        if budget_bytes < 2 * ALIGN:
            raise ValueError(f"buffer budget must be at least {2 * ALIGN} bytes, got {budget_bytes}")
        self.buffer_bytes = None if buffer_bytes is None else round_up(max(buffer_bytes, 1))
        if self.buffer_bytes is not None and self.buffer_bytes > budget_bytes:
            raise ValueError(f"{what}: buffers of {self.buffer_bytes} bytes do not fit the pool "
                             f"budget of {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._pin = pin
        self._ledger = ledger
        self._what = what
        self._register = register
        self._free: list[torch.Tensor] = []  # cached, whole allocations
        self._released = threading.Condition()
        self.allocated_bytes = 0  # held by callers plus cached
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0  # buffers made over the pool's life
        self.closed = False  # close(): buffers given back are dropped, not cached

    @property
    def depth(self) -> int | None:
        """How many buffers a fixed-size pool holds at most (None: sizes vary)."""
        return None if self.buffer_bytes is None else self.budget_bytes // self.buffer_bytes

    def acquire(self, nbytes: int, timeout: float = 600.0) -> torch.Tensor:
        """As try_acquire, waiting for another thread to release a buffer while
        none is free; a wait past `timeout` seconds is an error naming the pool
        (a thread waiting for buffers it holds itself would wait forever)."""
        with self._released:
            got = self._released.wait_for(lambda: boxed(self.try_acquire(nbytes)), timeout)
            if got is None:
                raise TimeoutError(f"{self._what}: no buffer of {nbytes} bytes came free in {timeout:.0f} s "
                                   f"({self.in_use_bytes} of {self.budget_bytes} bytes in use)")
            return got[0]

    def try_acquire(self, nbytes: int, *, keep_free_bytes: int = 0) -> torch.Tensor | None:
        """A whole aligned uint8 buffer of at least `nbytes`, or
        None while the budget is held by buffers in use (or taking one would
        leave less than keep_free_bytes of it for others)."""
        size = round_up(max(nbytes, 1))
        if self.buffer_bytes is not None:
            if size > self.buffer_bytes:
                raise ValueError(f"{self._what}: request of {size} bytes exceeds the pool's buffers "
                                 f"of {self.buffer_bytes}")
            size = self.buffer_bytes
        if size > self.budget_bytes:
            raise ValueError(f"request of {size} bytes exceeds the pool budget of {self.budget_bytes}")
        with self._released:
            if self.budget_bytes - self.in_use_bytes - size < keep_free_bytes:
                return None
            return self._try_acquire(size)

    def _try_acquire(self, size: int) -> torch.Tensor | None:
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
                self._ledger.charge(size, self._what)
            try:
                buf = aligned_empty(size, pin=self._pin)
                if self._register is not None:
                    buf = self._register(buf, self._what)
            except BaseException:
                if self._ledger is not None:
                    self._ledger.credit(size)
                raise
            self.allocated_bytes += size
            self.allocations += 1
        self.in_use_bytes += buf.numel()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def _take(self, buf: torch.Tensor) -> None:
        # By identity: list.remove would compare tensors elementwise.
        del self._free[next(i for i, b in enumerate(self._free) if b is buf)]

    def release(self, buf: torch.Tensor) -> None:
        with self._released:
            self.in_use_bytes -= buf.numel()
            if self.closed:  # a transfer that outlived close(): its buffer goes now
                self._drop(buf)
                return
            self._free.append(buf)
            self._released.notify_all()

    def fill(self) -> None:
        """Makes every buffer of a fixed-size pool now (at initialize: a budget
        that cannot hold them fails there, not mid-step)."""
        bufs = [self.try_acquire(self.buffer_bytes) for _ in range(self.depth)]
        for buf in bufs:
            self.release(buf)

    def clear(self) -> None:
        with self._released:
            for buf in self._free:
                self._drop(buf)
            self._free.clear()

    def close(self) -> None:
        """Drops every buffer, crediting the ledger: the cached ones now, any
        still held by a transfer when it is released. Idempotent."""
        with self._released:
            self.closed = True
        self.clear()

    def _drop(self, buf: torch.Tensor) -> None:
        self.allocated_bytes -= buf.numel()
        if self._ledger is not None:
            self._ledger.credit(buf.numel())


class PinnedLedger:
    """Page-locked host bytes of one engine, a Ledger (offload/accounting.py): charged to
    `host` (its host-tier ledger: pinned bytes are host bytes) and kept within `budget`
    (memory.pinned_budget; None: no bound)."""

    def __init__(self, host, budget: int | None):
        self._host, self.budget = host, budget
        self._lock = threading.Lock()
        self.now = self.peak = 0

    def charge(self, nbytes: int, what: str, *, host_charged: bool = False) -> None:
        """host_charged: the bytes are already charged to the host tier (a host
        home pinned after it was made): counted against the pinned budget only."""
        with self._lock:
            if self.budget is not None and self.now + nbytes > self.budget:
                raise TierBudgetError(f"memory.pinned_budget exceeded allocating {nbytes} pinned bytes for {what}: "
                                  f"{self.now} of {self.budget} bytes already pinned")
            if not host_charged:
                self._host.charge(nbytes, what)
            self.now += nbytes
            self.peak = max(self.peak, self.now)

    def credit(self, nbytes: int) -> None:
        with self._lock:
            self.now -= nbytes
            self._host.credit(nbytes)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(now=self.now, peak=self.peak, budget=self.budget)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.now
