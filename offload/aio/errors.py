"""Errors of the I/O layer. Every one names the file and the operation.

They derive from OSError (with the errno when there is one), so code that
already handles OSError keeps working, and tests can tell the cases apart.
"""
from __future__ import annotations

import errno as _errno
import os


class AioError(OSError):
    """An asynchronous pread/pwrite failed: `op` on `path` at file `offset`."""

    def __init__(self, err: int, op: str, path: str, offset: int | None = None, detail: str | None = None):
        self.op = op
        self.path = os.fspath(path)
        self.offset = offset
        reason = detail or (os.strerror(err) if err else "I/O error")
        where = f" at offset {offset}" if offset is not None else ""
        super().__init__(err, f"{op} {self.path}{where}: {reason}")
        # OSError keeps .filename for tools that look there.
        self.filename = self.path

    def __str__(self) -> str:  # OSError's default adds "[Errno N]" before our message
        return f"[Errno {self.errno}] {self.strerror}"


class DirectIOUnsupportedError(AioError):
    """The filesystem refused O_DIRECT (EINVAL at open). backend="auto" falls
    back to buffered threads instead of raising; explicit backends raise."""

    def __init__(self, op: str, path: str):
        super().__init__(
            _errno.EINVAL,
            op,
            path,
            detail="O_DIRECT refused by this filesystem; use backend='auto' or 'threads', "
            "which fall back to buffered I/O",
        )


class TruncatedFileError(AioError):
    """A read met end of file before the bytes it asked for."""

    def __init__(self, op: str, path: str, offset: int | None, detail: str):
        super().__init__(_errno.EIO, op, path, offset, detail)


class CorruptFileError(AioError):
    """A swap or checkpoint file whose header or checksum does not match."""

    def __init__(self, path: str, detail: str):
        super().__init__(_errno.EBADMSG, "verify", path, None, detail)


class SwapStoreError(OSError):
    """The swap store cannot be created here (path, permissions, free space)."""
