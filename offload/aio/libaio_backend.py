"""The `libaio` backend: Linux AIO through python-libaio (PyPI `libaio`).

python-libaio drives the system's libaio.so.1 with ctypes, so this backend
needs no compiler: it is the fast path for installs where the native
extension could not be built. Same structure as the native engine: one
worker thread per unit of `intra_op_parallelism`, each with its own AIO
context kept `queue_depth` deep. ctypes releases the GIL inside
io_getevents, so waiting threads do not hold up Python.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import threading

from offload.aio import _pyio
from offload.aio.memory import ALIGN

try:
    import libaio as _libaio

    IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 - ImportError, or OSError when libaio.so.1 is missing
    _libaio = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


_probe_worked = False


def unavailable_reason() -> str | None:
    if _libaio is None:
        return (f"python-libaio not importable ({IMPORT_ERROR}); `pip install libaio` and the "
                "system package libaio1 (Debian/Ubuntu: libaio1 or libaio1t64)")
    global _probe_worked
    if _probe_worked:  # Note [backend probe] in offload/aio/native.py
        return None
    try:
        _libaio.AIOContext(1).close()
    except OSError as exc:
        return f"io_setup failed: {exc}"
    _probe_worked = True
    return None


class _Worker:
    def __init__(self, block_size: int, queue_depth: int, faults: _pyio.FaultPlan):
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.faults = faults
        self._ctx = _libaio.AIOContext(queue_depth)
        self._bounce = [None] * queue_depth  # per slot, made on first use
        self._free = list(range(queue_depth))
        self._incoming: collections.deque = collections.deque()
        self._active: collections.deque = collections.deque()  # (request, unit), worker only
        self._in_flight = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="offload-libaio", daemon=True)
        self._thread.start()

    def enqueue(self, request, units) -> None:
        with self._cond:
            self._incoming.extend((request, u) for u in units)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        self._ctx.close()

    def _bounce_address(self, slot: int) -> int:
        if self._bounce[slot] is None:
            raw = ctypes.create_string_buffer(self.block_size + ALIGN)
            self._bounce[slot] = (raw, ctypes.addressof(raw) + (-ctypes.addressof(raw)) % ALIGN)
        return self._bounce[slot][1]

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._incoming or self._active
                                    or self._in_flight)
                if self._stopping and not (self._incoming or self._active or self._in_flight):
                    return
                self._active.extend(self._incoming)
                self._incoming.clear()
            self._issue()
            if self._in_flight:
                self._reap()

    def _issue(self) -> None:
        blocks = []
        while self._active and self._free:
            request, unit = self._active.popleft()
            if request.failed:
                request.unit_done()
                continue
            if not unit.direct:
                rc = _pyio.transfer_sync(request.file.buffered_fd(), request.op, unit.address,
                                         unit.length, unit.file_offset)
                rc = rc or self.faults.take(request.op)
                if rc:
                    request.fail(rc, unit.file_offset, request.op)
                request.unit_done()
                continue
            slot = self._free.pop()
            address = unit.address
            if address % ALIGN:
                address = self._bounce_address(slot)
                if request.op == "pwrite":
                    ctypes.memmove(address, unit.address, unit.length)
            mode = _libaio.AIOBLOCK_MODE_READ if request.op == "pread" else _libaio.AIOBLOCK_MODE_WRITE
            block = _libaio.AIOBlock(mode, request.file.direct_fd,
                                     [_pyio.c_buffer(address, unit.length)], unit.file_offset)
            block.offload = (request, unit, slot, address)
            blocks.append(block)
        if not blocks:
            return
        submitted = 0
        try:
            while submitted < len(blocks):
                submitted += self._ctx.submit(blocks[submitted:])
        except OSError as exc:
            for block in blocks[submitted:]:
                request, unit, slot, _ = block.offload
                request.fail(exc.errno or errno.EIO, unit.file_offset, "io_submit")
                request.unit_done()
                self._free.append(slot)
        self._in_flight += submitted

    def _reap(self) -> None:
        for block, res, _ in self._ctx.getEvents(min_nr=1):
            request, unit, slot, address = block.offload
            self._in_flight -= 1
            rc = -res if res < 0 else 0
            if not rc and res < unit.length:  # short: finish synchronously for the real cause
                fd = request.file.direct_fd if res % ALIGN == 0 else request.file.buffered_fd()
                rc = _pyio.transfer_sync(fd, request.op, address + res, unit.length - res,
                                         unit.file_offset + res, request.file.buffered_fd)
            rc = rc or self.faults.take(request.op)
            if rc:
                request.fail(rc, unit.file_offset, "completion" if res < 0 else request.op)
            elif request.op == "pread" and address != unit.address:
                ctypes.memmove(unit.address, address, unit.length)
            self._free.append(slot)
            request.unit_done()


class LibaioBackend:
    name = "libaio"

    def __init__(self, block_size: int, queue_depth: int, intra_op_parallelism: int):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"libaio backend unavailable: {reason}")
        self.block_size = block_size
        self.faults = _pyio.FaultPlan()
        self._workers = [_Worker(block_size, queue_depth, self.faults)
                         for _ in range(intra_op_parallelism)]
        self._next = 0

    def submit(self, op: str, address: int, nbytes: int, path: str, offset: int):
        request, units = _pyio.open_request(op, address, nbytes, path, offset, self.block_size,
                                            True, self.faults)
        if request.done():
            return request
        request.start(len(units))
        if not units:
            return request
        # Contiguous runs of units, one per worker, as the native engine splits.
        n = min(len(self._workers), len(units))
        per = -(-len(units) // n)
        for i in range(n):
            worker = self._workers[(self._next + i) % len(self._workers)]
            worker.enqueue(request, units[i * per : (i + 1) * per])
        self._next += 1
        return request

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
