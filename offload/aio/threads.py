"""The `threads` backend: blocking os.preadv/os.pwritev on a thread pool.

Works anywhere Python does. Queue depth is the number of threads (each keeps
one block in flight); O_DIRECT is used where the filesystem accepts it and
plain buffered I/O where it does not (tmpfs on old kernels, some network and
FUSE filesystems), which is why `auto` falls back to this backend.
"""
from __future__ import annotations

import ctypes
import errno
from concurrent.futures import ThreadPoolExecutor

from offload.aio import _pyio
from offload.aio.memory import ALIGN

MAX_THREADS = 64


class ThreadsBackend:
    name = "threads"

    def __init__(self, block_size: int, queue_depth: int, intra_op_parallelism: int):
        self.block_size = block_size
        self.threads = min(MAX_THREADS, max(queue_depth, intra_op_parallelism))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="offload-aio")
        self._bounce = _pyio.BounceBuffers(block_size)
        self.faults = _pyio.FaultPlan()

    def submit(self, op: str, address: int, nbytes: int, path: str, offset: int):
        request, units = _pyio.open_request(op, address, nbytes, path, offset, self.block_size,
                                            True, self.faults)
        if request.error == errno.EINVAL and request.error_stage == "open(O_DIRECT)":
            # No direct I/O on this filesystem: buffered I/O is this backend's job.
            request, units = _pyio.open_request(op, address, nbytes, path, offset,
                                                self.block_size, False, self.faults)
        if request.done():
            return request
        request.start(len(units))
        for unit in units:
            self._pool.submit(self._run, request, unit)
        return request

    def _run(self, request: _pyio.PyRequest, unit: _pyio.Unit) -> None:
        try:
            if request.failed:
                return
            op, file = request.op, request.file
            address = unit.address
            bounce = unit.direct and address % ALIGN != 0
            if bounce:
                address = self._bounce.get()
                if op == "pwrite":
                    ctypes.memmove(address, unit.address, unit.length)
            if unit.direct:
                rc = _pyio.transfer_sync(file.direct_fd, op, address, unit.length,
                                         unit.file_offset, file.buffered_fd)
            else:
                rc = _pyio.transfer_sync(file.buffered_fd(), op, address, unit.length,
                                         unit.file_offset)
            rc = rc or self.faults.take(op)
            if rc:
                request.fail(rc, unit.file_offset, op)
            elif bounce and op == "pread":
                ctypes.memmove(unit.address, address, unit.length)
        except BaseException as exc:  # noqa: BLE001 - never leave a request pending
            request.fail(getattr(exc, "errno", None) or errno.EIO, unit.file_offset, request.op)
        finally:
            request.unit_done()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
