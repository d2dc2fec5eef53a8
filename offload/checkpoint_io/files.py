"""File primitives for checkpoints: durable writes, checksummed copies, and a
safetensors writer that streams one tensor at a time.

Every function that writes returns (bytes, checksum) of what it wrote, so the
manifest is built from the bytes as they went out, without a second read.
Checksums are offload.aio's (CRC-32C with the native extension, else zlib's
CRC-32); the manifest records which.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from offload.aio.checksum import ChecksumKind, checksum, default_kind
from offload.aio.swap_dir import fsync_path

COPY_CHUNK = 8 << 20  # bytes of host memory a copy or a verification uses at once

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def kind() -> ChecksumKind:
    return default_kind()


def crc_bytes(data, crc: int = 0, kind_: ChecksumKind | None = None) -> int:
    """Continues `crc` over a bytes-like object."""
    if len(data) == 0:
        return crc
    view = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)
    return checksum(kind_ or kind(), view, crc)


def write_bytes(path: Path, data: bytes) -> tuple[int, int]:
    """Writes and fsyncs a small file; returns (bytes, checksum)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), crc_bytes(data)


def replace_durably(tmp: Path, final: Path) -> None:
    """Renames tmp over final and fsyncs the directory, so the rename survives a crash."""
    os.replace(tmp, final)
    fsync_path(final.parent)


def copy_file(src: Path, dst: Path) -> tuple[int, int]:
    """Copies src to dst through one bounded buffer, checksumming on the way.

    Not os.copy_file_range / shutil.copyfile: the manifest needs the checksum
    of every byte, so a kernel-side copy would be followed by a second read of
    the copy; one user-space pass reads each byte once. Not a hard link: swap
    files are rewritten in place by the next optimizer step.
    """
    buf = bytearray(COPY_CHUNK)
    view = memoryview(buf)
    as_tensor = torch.frombuffer(buf, dtype=torch.uint8)
    total, crc, k = 0, 0, kind()
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while True:
            n = fin.readinto(view)
            if not n:
                break
            crc = checksum(k, as_tensor[:n], crc)
            fout.write(view[:n])
            total += n
        fout.flush()
        os.fsync(fout.fileno())
    return total, crc


def file_checksum(path: Path, kind_: ChecksumKind) -> tuple[int, int]:
    """(bytes, checksum) of a file, read through one bounded buffer."""
    buf = bytearray(COPY_CHUNK)
    view = memoryview(buf)
    as_tensor = torch.frombuffer(buf, dtype=torch.uint8)
    total, crc = 0, 0
    with open(path, "rb") as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            crc = checksum(kind_, as_tensor[:n], crc)
            total += n
    return total, crc


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (any dtype)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


class SafetensorsStream:
    """Writes a safetensors file whose tensors arrive one at a time.

    safetensors.torch.save_file takes a dict of every tensor, so a whole
    model (or a rank's whole optimizer state) would have to sit in host
    memory at once. The format is simple and fixed (little-endian u64 header
    length, a JSON header of dtype/shape/byte offsets padded with spaces to 8
    bytes, then the raw bytes in offset order), and every name, dtype and
    shape is known before the first byte, so the header is written first and
    each tensor streams after it. Files are read back with the library
    (safe_open), which checks the layout; tests do the same.
    """

    def __init__(self, path: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        self._plan = []
        for name, dtype, shape in plan:
            if dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"tensor {name!r}: dtype {dtype} has no safetensors encoding")
            if name in header:
                raise ValueError(f"tensor {name!r} appears twice in the plan")
            nbytes = dtype.itemsize * _numel(shape)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._plan.append((name, dtype, tuple(shape)))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._next = 0
        self._file = open(path, "wb")
        self.bytes, self.crc = 0, 0
        self._emit(struct.pack("<Q", len(blob)) + blob)

    def _emit(self, data, tensor: torch.Tensor | None = None) -> None:
        self._file.write(data)
        self.bytes += len(data)
        if tensor is None:
            self.crc = crc_bytes(data, self.crc)
        elif tensor.numel():
            self.crc = checksum(kind(), tensor, self.crc)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Appends the next tensor of the plan (any device; copied to the host if not there)."""
        if self._next >= len(self._plan):
            raise ValueError(f"tensor {name!r}: every tensor of the plan is written already")
        want_name, want_dtype, want_shape = self._plan[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want_name, want_dtype, want_shape):
            raise ValueError(f"expected tensor {want_name!r} {want_dtype} {list(want_shape)} next, "
                             f"got {name!r} {tensor.dtype} {list(tensor.shape)}")
        host = tensor.detach().to("cpu").contiguous()
        self._emit(tensor_bytes(host), host)
        self._next += 1

    def close(self) -> tuple[int, int]:
        """Flushes and fsyncs; returns (bytes, checksum) of the whole file."""
        try:
            if self._next != len(self._plan):
                raise ValueError(f"safetensors file closed after {self._next} of "
                                 f"{len(self._plan)} tensors (next: {self._plan[self._next][0]!r})")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        return self.bytes, self.crc

    def abort(self) -> None:
        self._file.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
