"""Aligned host buffers and raw views of tensor memory.

O_DIRECT needs 4096-byte aligned addresses; torch's CPU allocator aligns to
64 bytes only, so buffers meant for disk come from here. Pinned (page-locked)
when CUDA exists, since the same buffers feed host-to-device copies.
"""
from __future__ import annotations

import ctypes
import functools

import torch

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@functools.lru_cache(maxsize=1)
def pin_by_default() -> bool:
    return torch.cuda.is_available()


def aligned_empty(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose data_ptr is 4096-aligned.

    Over-allocates by one alignment unit and slices; the slice keeps the
    whole allocation alive.
    """
    pin = pin_by_default() if pin is None else pin
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def aligned_tensor(numel: int, dtype: torch.dtype, pin: bool | None = None) -> torch.Tensor:
    """An uninitialised 1-D tensor whose memory is 4096-aligned, so the swap
    store moves it to and from disk with no staging copy."""
    return aligned_empty(numel * dtype.itemsize, pin=pin).view(dtype)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage bytes as a flat uint8 tensor (no copy)."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8)


def c_buffer(address: int, nbytes: int):
    """A writable buffer object over raw memory, for os.preadv/pwritev and libaio."""
    return (ctypes.c_char * nbytes).from_address(address)
