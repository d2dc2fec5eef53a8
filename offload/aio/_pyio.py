"""What the two pure-Python backends (libaio, threads) share with each other.

They follow the native engine's rules (Note [aligned blocks and fragments] in
csrc/aio/aio_engine.h): aligned blocks go through an O_DIRECT descriptor,
staged through an aligned bounce buffer when the memory is not aligned;
unaligned head and tail fragments go through a buffered descriptor. Their
requests expose the same fields as the native one, so offload/aio/__init__.py
turns failures into exceptions in one place.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from dataclasses import dataclass

from offload.aio.memory import ALIGN, c_buffer

TRUNCATED = -1  # transfer_sync's "end of file came first"


@dataclass(frozen=True)
class Unit:
    """One piece of a transfer: an aligned block (direct) or a fragment."""

    direct: bool
    file_offset: int
    address: int
    length: int


def plan_units(address: int, nbytes: int, offset: int, block_size: int, direct: bool) -> list[Unit]:
    """Cuts [offset, offset + nbytes) as the native engine does."""
    units = []
    pos, end = offset, offset + nbytes
    aligned_end = end // ALIGN * ALIGN
    while pos < end:
        if not direct:
            length = min(block_size, end - pos)
            units.append(Unit(False, pos, address + pos - offset, length))
        elif pos % ALIGN or pos >= aligned_end:
            stop = min((pos + ALIGN - 1) // ALIGN * ALIGN, end) if pos % ALIGN else end
            length = stop - pos
            units.append(Unit(False, pos, address + pos - offset, length))
        else:
            length = min(block_size, aligned_end - pos)
            units.append(Unit(True, pos, address + pos - offset, length))
        pos += length
    return units


def transfer_sync(fd: int, op: str, address: int, length: int, offset: int,
                  buffered_fd=None) -> int:
    """Blocking pread/pwrite of the whole range: 0, an errno, or TRUNCATED.

    After a short transfer that leaves the position unaligned, an O_DIRECT
    descriptor can no longer continue; `buffered_fd()` supplies one that can.
    """
    while length > 0:
        buf = c_buffer(address, length)
        try:
            n = os.preadv(fd, [buf], offset) if op == "pread" else os.pwritev(fd, [buf], offset)
        except InterruptedError:
            continue
        except OSError as exc:
            return exc.errno or errno.EIO
        if n == 0:
            return TRUNCATED if op == "pread" else errno.EIO
        address, length, offset = address + n, length - n, offset + n
        if length and n % ALIGN and buffered_fd is not None:
            fd, buffered_fd = buffered_fd(), None
    return 0


class FaultPlan:
    """Test hook, same meaning as the native one: the Nth next unit of `op`
    completes with -errno and flows through the normal completion path."""

    def __init__(self):
        self._lock = threading.Lock()
        self._armed = None  # (op, errno, countdown)
        self.refuse_direct = False

    def arm(self, op: str, err: int, after_units: int) -> None:
        with self._lock:
            self._armed = [op, err, after_units]

    def clear(self) -> None:
        with self._lock:
            self._armed = None
            self.refuse_direct = False

    def take(self, op: str) -> int:
        if self._armed is None:
            return 0
        with self._lock:
            if self._armed is None or self._armed[0] != op:
                return 0
            if self._armed[2] > 0:
                self._armed[2] -= 1
                return 0
            err = self._armed[1]
            self._armed = None
            return err


class OpenFile:
    """The O_DIRECT descriptor (None where direct I/O was not asked for) and a
    buffered one opened on first use; both closed by close()."""

    def __init__(self, path: str, op: str, direct: bool, faults: FaultPlan):
        self.path = path
        # O_NOFOLLOW: a symlink at the name fails the open (ELOOP) rather than being
        # written through (Note [creating swap files] in offload/aio/swap_store.py).
        self._flags = ((os.O_RDONLY if op == "pread" else os.O_WRONLY | os.O_CREAT)
                       | os.O_CLOEXEC | os.O_NOFOLLOW)
        self.direct_fd = None
        self._buffered_fd = None
        self._lock = threading.Lock()
        if direct:
            if faults.refuse_direct:
                raise OSError(errno.EINVAL, "O_DIRECT refused (injected)")
            self.direct_fd = os.open(path, self._flags | os.O_DIRECT, 0o600)
        else:
            self._buffered_fd = os.open(path, self._flags, 0o600)

    def buffered_fd(self) -> int:
        with self._lock:
            if self._buffered_fd is None:
                self._buffered_fd = os.open(self.path, self._flags & ~os.O_CREAT)
            return self._buffered_fd

    def close(self) -> None:
        for fd in (self.direct_fd, self._buffered_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = self._buffered_fd = None


class PyRequest:
    """Completion state of one transfer, mirroring offload._C.aio.Request."""

    def __init__(self, op: str, path: str, offset: int, nbytes: int):
        self.op, self.path, self.offset, self.nbytes = op, path, offset, nbytes
        self.error = 0
        self.truncated = False
        self.error_offset = 0
        self.error_stage = ""
        self.file: OpenFile | None = None
        self._pending = 1  # not started: start() sets the unit count
        self._cond = threading.Condition()

    def start(self, units: int) -> None:
        self._pending = units
        if units == 0:
            self._finish()

    def fail(self, err: int, offset: int, stage: str) -> None:
        with self._cond:
            if self.error or self.truncated:
                return  # the first failure is the cause
            self.truncated = err == TRUNCATED
            self.error = 0 if self.truncated else err
            self.error_offset, self.error_stage = offset, stage

    @property
    def failed(self) -> bool:
        return bool(self.error or self.truncated)

    def unit_done(self) -> None:
        with self._cond:
            self._pending -= 1
            if self._pending > 0:
                return
        self._finish()

    def _finish(self) -> None:
        if self.file is not None:
            self.file.close()  # before waking waiters: a waiter may rename the file
        with self._cond:
            self._pending = 0
            self._cond.notify_all()

    def done(self) -> bool:
        with self._cond:
            return self._pending == 0

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)


def open_request(op: str, address: int, nbytes: int, path: str, offset: int, block_size: int,
                 direct: bool, faults: FaultPlan) -> tuple[PyRequest, list[Unit]]:
    """Opens the file and plans the units; an open failure comes back as an
    already-completed request carrying it (as the native engine does)."""
    request = PyRequest(op, path, offset, nbytes)
    try:
        request.file = OpenFile(path, op, direct, faults)
    except OSError as exc:
        request.fail(exc.errno or errno.EIO, offset, "open(O_DIRECT)" if direct else "open")
        request.start(0)
        return request, []
    return request, plan_units(address, nbytes, offset, block_size, direct)


class BounceBuffers(threading.local):
    """One aligned block-sized staging buffer per thread, made on first use."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.buffer = None

    def get(self):
        if self.buffer is None:
            raw = ctypes.create_string_buffer(self.block_size + ALIGN)
            skip = (-ctypes.addressof(raw)) % ALIGN
            self.buffer = (raw, ctypes.addressof(raw) + skip)
        return self.buffer[1]
