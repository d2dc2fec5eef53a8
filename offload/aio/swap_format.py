"""The swap file format: one tensor per file, a 4096-byte header, then its data.

Note [swap file format]
One file per key, `<quoted key>.swp`: a 4096-byte header, then the tensor's
bytes padded to a multiple of 4096, so every transfer is aligned and O_DIRECT
needs no staging copy. The header holds a magic, the byte count, dtype,
shape, key, the data checksum (CRC-32C, or none) and a CRC of the header
itself. A write goes to `.<name>.tmp` and is renamed over the final name only
after every byte landed (and, with `durable`, after fsync), so a file under
its final name is never half written; a truncated file fails the read with
TruncatedFileError and a damaged one with CorruptFileError.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from offload.aio.checksum import ChecksumKind
from offload.aio.errors import CorruptFileError
from offload.aio.memory import ALIGN, round_up

HEADER_BYTES = ALIGN
_MAGIC = b"OFFLSWP1"
_FIXED = struct.Struct("<8sIIQII16sII")  # magic, version, header crc, nbytes, kind, crc, dtype, ndim, key len
_VERSION = 1


def file_bytes(nbytes: int) -> int:
    """Size on disk of a tensor of `nbytes` (header + padded data)."""
    return HEADER_BYTES + round_up(nbytes)


@dataclass
class SwapMeta:
    """What a swap file's header says of its tensor."""

    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def write_header(buf: torch.Tensor, key: str, meta: SwapMeta, kind: ChecksumKind, crc: int) -> None:
    key_bytes = key.encode()
    dtype = str(meta.dtype).removeprefix("torch.").encode()
    body = _FIXED.pack(_MAGIC, _VERSION, 0, meta.nbytes, int(kind), crc, dtype, len(meta.shape),
                       len(key_bytes))
    body += struct.pack(f"<{len(meta.shape)}Q", *meta.shape) + key_bytes
    if len(body) > HEADER_BYTES:
        raise ValueError(f"key {key!r} and shape {meta.shape} do not fit the {HEADER_BYTES}-byte header")
    page = bytearray(HEADER_BYTES)
    page[:len(body)] = body
    struct.pack_into("<I", page, 12, zlib.crc32(page[16:]))
    buf[:HEADER_BYTES].copy_(torch.frombuffer(page, dtype=torch.uint8))


def parse_header(buf: torch.Tensor, path, key: str) -> tuple[int, ChecksumKind, int]:
    page = bytes(buf[:HEADER_BYTES].numpy())
    magic, version, header_crc, nbytes, kind, crc, _, _, _ = _FIXED.unpack_from(page)
    if magic != _MAGIC:
        raise CorruptFileError(str(path), f"not an offload swap file (magic {magic!r})")
    if version != _VERSION:
        raise CorruptFileError(str(path), f"format version {version}, this build reads {_VERSION}")
    if zlib.crc32(page[16:]) != header_crc:
        raise CorruptFileError(str(path), "header checksum mismatch")
    try:
        return nbytes, ChecksumKind(kind), crc
    except ValueError:
        raise CorruptFileError(str(path), f"unknown checksum kind {kind}") from None


def parse_meta(buf: torch.Tensor, path, key: str) -> SwapMeta:
    """A swap file's header: its payload bytes, dtype and shape (checkpoints read copied files)."""
    nbytes, _, _ = parse_header(buf, path, key)
    page = bytes(buf[:HEADER_BYTES].numpy())
    fields = _FIXED.unpack_from(page)
    dtype, ndim = fields[6].rstrip(b"\0").decode(), fields[7]
    shape = struct.unpack_from(f"<{ndim}Q", page, _FIXED.size)
    return SwapMeta(nbytes, getattr(torch, dtype), tuple(shape))
