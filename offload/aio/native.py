"""The `native` backend: offload._C.aio.Engine (csrc/aio/aio_engine.h).

Raw Linux AIO system calls from C++ worker threads; no libaio needed to build
or run. The engine's requests already carry the fields the facade reads
(error, truncated, error_offset, error_stage), so this wrapper is thin.
"""
from __future__ import annotations

from offload import _native


# Note [backend probe]: a probe makes and tears down a real AIO context (about
# 30 ms), and every AsyncIO asked for it up to twice, so each NVMe engine's
# open and close took 0.26 s instead of 0.06 s. A probe that worked is
# remembered for the process; one that failed is tried again next time (a
# refused io_setup can be aio-max-nr, exhausted for a while by other contexts).
_probe_worked = False


def unavailable_reason() -> str | None:
    global _probe_worked
    if _native.native is None:
        return f"native extension not built ({_native.IMPORT_ERROR})"
    if _probe_worked:
        return None
    try:
        _native.native.aio.Engine(4096, 1, 1)
    except (OSError, RuntimeError) as exc:  # io_setup refused (aio-max-nr, seccomp)
        return f"io_setup failed: {exc}"
    _probe_worked = True
    return None


class _Faults:
    """The engine's test hooks behind the interface the Python backends use."""

    def __init__(self, engine):
        self._engine = engine

    def arm(self, op: str, err: int, after_units: int) -> None:
        self._engine._inject_fault(op, err, after_units)

    def clear(self) -> None:
        self._engine._clear_faults()

    @property
    def refuse_direct(self) -> bool:
        raise AttributeError("write-only")

    @refuse_direct.setter
    def refuse_direct(self, value: bool) -> None:
        self._engine._refuse_direct(value)


class NativeBackend:
    name = "native"

    def __init__(self, block_size: int, queue_depth: int, intra_op_parallelism: int):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"native backend unavailable: {reason}")
        self._engine = _native.native.aio.Engine(block_size, queue_depth, intra_op_parallelism)
        self.faults = _Faults(self._engine)

    def submit(self, op: str, address: int, nbytes: int, path: str, offset: int):
        if op == "pread":
            return self._engine.pread(address, nbytes, path, offset)
        return self._engine.pwrite(address, nbytes, path, offset)

    def close(self) -> None:
        self._engine = None  # ~AioEngine finishes queued transfers, then joins
