"""CRC-32C of tensor bytes, for swap and checkpoint files.

Measured on the reference machine (2-core VM, 1 GiB buffer): the native
SSE4.2 kernel (offload._C.aio.crc32c) runs at ~9 GB/s, zlib.crc32 at ~3.1 GB/s
(about the disk's own write speed, so it would double the cost of a checked
write), the portable table reference at well under 1 GB/s. Without the
extension we fall back to zlib.crc32, a different polynomial: the file header
records which algorithm wrote it, so a file is always verified with its own.
"""
from __future__ import annotations

import enum
import zlib

import torch

from offload import _native
from offload.aio.memory import byte_view


class ChecksumKind(enum.IntEnum):
    """Stored in file headers; values are part of the on-disk format."""

    NONE = 0
    CRC32C = 1  # native, SSE4.2 when the CPU has it
    CRC32 = 2   # zlib, when the extension is missing


def default_kind() -> ChecksumKind:
    return ChecksumKind.CRC32C if _native.available() else ChecksumKind.CRC32


def checksum(kind: ChecksumKind, tensor: torch.Tensor, crc: int = 0) -> int:
    """Continues `crc` over the tensor's bytes (chained calls = concatenation)."""
    data = byte_view(tensor)
    if kind is ChecksumKind.NONE:
        return 0
    if kind is ChecksumKind.CRC32C:
        if _native.native is None:
            raise RuntimeError("this file was written with CRC-32C, which needs the native extension")
        return _native.native.aio.crc32c(data.data_ptr(), data.numel(), crc)
    return zlib.crc32(memoryview(data.numpy()), crc)
