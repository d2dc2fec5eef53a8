"""The NVMe tier's I/O layer: asynchronous pread/pwrite of tensors, and the
swap store built on it. Design and measurements: docs/AIO.md.

    io = AsyncIO(block_size=1 << 20, queue_depth=32, intra_op_parallelism=1, backend="auto")
    req = io.pwrite(tensor, "/nvme/x.bin")   # returns at once
    ...
    req.wait()                               # raises AioError naming path and op

Tensors are CPU and contiguous; 4096-aligned memory (`aligned_empty`) avoids
a staging copy under O_DIRECT. Every backend honours the same contract,
checked by tests/aio/test_aio_contract.py.
"""
from __future__ import annotations

import errno
import os
import threading
import time
import warnings

import torch

from offload.aio.memory import ALIGN, aligned_empty, aligned_tensor, byte_view
from offload.aio.config import AioConfig, Backend
from offload.aio.errors import (
    AioError,
    CorruptFileError,
    DirectIOUnsupportedError,
    SwapStoreError,
    TruncatedFileError,
)

__all__ = [
    "ALIGN", "AioConfig", "AioError", "AsyncIO", "Backend", "CorruptFileError",
    "DirectIOUnsupportedError", "Request", "SwapStoreError", "TruncatedFileError",
    "aligned_empty", "aligned_tensor", "available_backends", "backend_report",
]

# Fastest first; `auto` takes the first available.
_PREFERENCE = (Backend.NATIVE, Backend.LIBAIO, Backend.THREADS)


def _backend_class(backend: Backend):
    if backend is Backend.NATIVE:
        from offload.aio.native import NativeBackend

        return NativeBackend
    if backend is Backend.LIBAIO:
        from offload.aio.libaio_backend import LibaioBackend

        return LibaioBackend
    from offload.aio.threads import ThreadsBackend

    return ThreadsBackend


def unavailable_reason(backend: Backend) -> str | None:
    """None if `backend` works here, else why not."""
    if backend is Backend.NATIVE:
        from offload.aio import native

        return native.unavailable_reason()
    if backend is Backend.LIBAIO:
        from offload.aio import libaio_backend

        return libaio_backend.unavailable_reason()
    return None


def available_backends() -> list[Backend]:
    return [b for b in _PREFERENCE if unavailable_reason(b) is None]


def backend_report() -> dict:
    """For `offload report`: each backend's state and what `auto` picks."""
    report = {}
    for b in _PREFERENCE:
        reason = unavailable_reason(b)
        report[b.value] = "available" if reason is None else f"unavailable: {reason}"
    avail = available_backends()
    report["auto"] = f"uses {avail[0].value}" if avail else "no backend available"
    return report


_warned_direct: set[str] = set()
_warn_lock = threading.Lock()


def _warn_buffered_once(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with _warn_lock:
        if _warned_direct:
            return
        _warned_direct.add(directory)
    warnings.warn(
        f"offload.aio: O_DIRECT is refused under {directory}; backend='auto' falls back to "
        "buffered I/O on threads (slower, and reads may come from the page cache)",
        RuntimeWarning,
        stacklevel=4,
    )


class Request:
    """One asynchronous transfer: the tensor it reads into or writes from,
    paired with the backend request that completes it. The tensor is kept
    alive until the transfer is over, whether or not the caller keeps this."""

    __slots__ = ("tensor", "op", "path", "offset", "nbytes", "backend", "_impl", "_t0", "_seconds",
                 "_error")

    def __init__(self, tensor, op, path, offset, nbytes, backend, impl):
        self.tensor, self.op, self.path, self.offset, self.nbytes = tensor, op, path, offset, nbytes
        self.backend = backend
        self._impl = impl
        self._t0 = time.perf_counter()
        self._seconds = None
        self._error = None

    def done(self) -> bool:
        """True once the transfer is over (successfully or not); never raises."""
        return self._impl.done()

    def wait(self) -> None:
        """Blocks (GIL released) until the transfer is over; raises AioError
        naming path and operation if it failed. Idempotent."""
        if self._seconds is None:
            self._impl.wait()
            self._seconds = time.perf_counter() - self._t0
            self._error = _error_of(self._impl, self.op, self.path, self.nbytes, self.offset)
            # The transfer is over: the memory is the caller's again (a lent
            # buffer must not stay alive through this request).
            self.tensor = None
        if self._error is not None:
            raise self._error

    @property
    def seconds(self) -> float | None:
        """Submit-to-observed-completion time, once wait() has returned."""
        return self._seconds


def _error_of(impl, op: str, path: str, nbytes: int, offset: int) -> AioError | None:
    if impl.truncated:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        return TruncatedFileError(
            op, path, impl.error_offset,
            f"file ends at byte {size}, before the {nbytes} bytes asked for at offset {offset} "
            "(truncated or still being written)",
        )
    if not impl.error:
        return None
    stage = impl.error_stage
    if impl.error == errno.EINVAL and stage == "open(O_DIRECT)":
        return DirectIOUnsupportedError(op, path)
    detail = os.strerror(impl.error)
    if stage.startswith("open"):
        detail = f"{stage} failed: {detail}"
    return AioError(impl.error, op, path, impl.error_offset, detail)


class AsyncIO:
    """Asynchronous pread/pwrite of CPU tensors through one backend.

    `backend="auto"` uses the fastest available (native, libaio, threads) and,
    for a file whose filesystem refuses O_DIRECT, buffered threads instead,
    warning once. Not tied to a thread: requests may be waited on anywhere.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, intra_op_parallelism: int = 1,
                 backend: Backend | str = Backend.AUTO, *, config: AioConfig | None = None):
        self.config = config or AioConfig(block_size=block_size, queue_depth=queue_depth,
                                          intra_op_parallelism=intra_op_parallelism, backend=backend)
        choice = self.config.backend
        self._auto = choice is Backend.AUTO
        if self._auto:
            avail = available_backends()
            choice = avail[0]
        else:
            reason = unavailable_reason(choice)
            if reason:
                raise RuntimeError(f"aio backend {choice.value!r} is unavailable: {reason}")
        self.backend = choice
        self._impl = self._make(choice)
        self._fallback = self._impl if choice is Backend.THREADS else None
        self._inflight: list[Request] = []
        self._lock = threading.Lock()

    def _make(self, backend: Backend):
        c = self.config
        return _backend_class(backend)(c.block_size, c.queue_depth, c.intra_op_parallelism)

    # ------------------------------------------------------------- transfers

    def pwrite(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> Request:
        """Starts writing the tensor's bytes to `path` at `offset` (the file is
        created if missing, never truncated)."""
        return self._submit("pwrite", tensor, path, offset)

    def pread(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> Request:
        """Starts reading tensor.nbytes bytes of `path` at `offset` into it."""
        return self._submit("pread", tensor, path, offset)

    def sync_pwrite(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> int:
        self.pwrite(tensor, path, offset).wait()
        return tensor.numel() * tensor.element_size()

    def sync_pread(self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0) -> int:
        self.pread(tensor, path, offset).wait()
        return tensor.numel() * tensor.element_size()

    def _submit(self, op: str, tensor: torch.Tensor, path, offset: int) -> Request:
        _check_tensor(tensor, op)
        if offset < 0:
            raise ValueError(f"{op}: offset must be >= 0, got {offset}")
        path = os.fspath(path)
        data = byte_view(tensor)
        nbytes = data.numel()
        impl = self._impl.submit(op, data.data_ptr(), nbytes, path, offset)
        backend = self.backend
        if (self._auto and impl.done() and impl.error == errno.EINVAL
                and impl.error_stage == "open(O_DIRECT)" and backend is not Backend.THREADS):
            _warn_buffered_once(path)
            if self._fallback is None:
                self._fallback = self._make(Backend.THREADS)
            impl = self._fallback.submit(op, data.data_ptr(), nbytes, path, offset)
            backend = Backend.THREADS
        request = Request(tensor, op, path, offset, nbytes, backend, impl)
        if impl.done() and impl.error and impl.error_stage.startswith("open"):
            request.wait()  # an open failure is observed here, by this call: raise now
        with self._lock:
            self._inflight = [r for r in self._inflight if not r.done()]
            self._inflight.append(request)
        return request

    # -------------------------------------------------------------- test hooks

    def _inject_fault(self, op: str, err: int, after_units: int = 0) -> None:
        """Test hook: the Nth next block or fragment of `op` completes with
        -err through the backend's real completion path."""
        self._impl.faults.arm(op, err, after_units)

    def _refuse_direct(self, refuse: bool = True) -> None:
        """Test hook: opening with O_DIRECT fails with EINVAL, as on a
        filesystem without direct I/O."""
        self._impl.faults.refuse_direct = refuse

    def _clear_faults(self) -> None:
        self._impl.faults.clear()

    # -------------------------------------------------------------- lifetime

    def drain(self) -> None:
        """Waits for every transfer still in flight (errors are left to their Request)."""
        with self._lock:
            pending, self._inflight = self._inflight, []
        for r in pending:
            r._impl.wait()

    def close(self) -> None:
        self.drain()
        for impl in {id(self._impl): self._impl, id(self._fallback): self._fallback}.values():
            if impl is not None:
                impl.close()

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"AsyncIO(backend={self.backend.value}, block_size={c.block_size}, "
                f"queue_depth={c.queue_depth}, intra_op_parallelism={c.intra_op_parallelism})")


_pin_warned = False


def _check_tensor(tensor: torch.Tensor, op: str) -> None:
    global _pin_warned
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{op}: tensor must be on the CPU, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: tensor must be contiguous")
    if not _pin_warned and torch.cuda.is_available() and not tensor.is_pinned():
        _pin_warned = True
        warnings.warn(f"offload.aio.{op}: tensor is not pinned; use offload.aio.aligned_empty "
                      "so host-to-device copies can overlap", RuntimeWarning, stacklevel=4)
