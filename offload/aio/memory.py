"""Aligned host buffers and raw views of tensor memory.

O_DIRECT needs 4096-byte aligned addresses; torch's CPU allocator aligns to
64 bytes only, so buffers meant for disk come from here. Pinned (page-locked)
when CUDA exists, since the same buffers feed host-to-device copies.
"""
from __future__ import annotations

import ctypes
import functools
import mmap

import torch

ALIGN = 4096
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@functools.lru_cache(maxsize=1)
def pin_by_default() -> bool:
    return torch.cuda.is_available()


def pins(*, cuda: bool, pin_memory: bool) -> bool:
    """Whether host buffers that feed the device are pinned: only with CUDA (a
    CPU-only host has nothing to pin for) and only when the config's
    pin_memory allows it (Note [pin_memory] in offload/config/sections.py)."""
    return cuda and pin_memory


def pin_host_home(nbytes: int, *, cuda: bool, pin_memory: bool, pinned_committed: int,
                  pinned_budget: int | None) -> bool:
    """Whether a parameter's host home of `nbytes` is pinned: when buffers are
    pinned at all (`pins`) and it fits what memory.pinned_budget leaves after
    the pinned bytes already committed (the staging pool first, then earlier
    homes). A home that does not fit stays in pageable memory: slower to copy,
    never an error."""
    if not pins(cuda=cuda, pin_memory=pin_memory):
        return False
    return pinned_budget is None or pinned_committed + nbytes <= pinned_budget


def aligned_empty(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose data_ptr is 4096-aligned.

    Unpinned buffers of a huge page or more are mapped on their own, in huge
    pages where the kernel allows (Note [huge pages for swap buffers]).
    Others over-allocate by one alignment unit and slice; the slice keeps the
    whole allocation alive.
    """
    pin = pin_by_default() if pin is None else pin
    if not pin and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        return _huge_page_mapping(nbytes)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


# Note [huge pages for swap buffers]
# A swap buffer is tens of MiB that the kernel hands over zeroed, one page
# fault per page, each time one is allocated fresh (the optimizer's state
# buffers are, once per step: kept, they would sit resident through the next
# forward). In 4 KiB pages that was 100k faults per step for GPT 67M on NVMe,
# taken on the threads that also run the optimizer and submit I/O. A mapping
# of its own, advised MADV_HUGEPAGE, faults once per 2 MiB, and munmap returns
# it to the OS the moment the tensor dies, as `map_large_allocations` does for
# torch's own allocations. Measured, same model: step 2.49 -> 2.23 s, peak
# RSS unchanged (0.81 GiB). The advice is only advice: with transparent huge
# pages set to "never" the mapping is served in base pages, still aligned.
def _huge_page_mapping(nbytes: int) -> torch.Tensor:
    try:
        mapping = mmap.mmap(-1, round_up(nbytes, HUGE_PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # ENOMEM: say what was asked, as torch's allocator would
        raise MemoryError(f"could not map {nbytes} bytes ({nbytes / 2**20:.1f} MiB) for an aligned "
                          f"host buffer: {exc.strerror or exc}") from exc
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages
        pass
    # The tensor holds the mapping (torch.frombuffer keeps a reference), which
    # is unmapped when the last view of the tensor's storage is gone.
    return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]


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


class BufferCache:
    """Aligned host buffers kept for reuse, by size.

    Why: a parameter gathered, or an optimizer state partition read, is a
    buffer of tens of MiB allocated and freed every step. Fresh, each is
    mmapped by malloc and every page is faulted in and zeroed by the kernel
    (about 1.3 GB per step for a 67M-parameter model with everything on NVMe),
    or it comes from a heap that fragments. Reused, it costs nothing.

    A buffer given back is reused only once nothing else holds its storage
    (an I/O request still writing from it, a view someone kept): a caller may
    give a buffer back as soon as it stops using it itself. Idle buffers are
    charged to `charge(nbytes)` / `credit(nbytes)` (the host tier) and the
    cache holds at most `max_bytes` of them, dropping the oldest.
    """

    def __init__(self, max_bytes: int, charge=None, credit=None):
        self.max_bytes = max_bytes
        self._charge, self._credit = charge, credit
        self._idle: list[torch.Tensor] = []  # uint8, oldest first
        self._lent: dict[int, torch.Tensor] = {}  # address -> whole buffer, for a slice lent out
        self.idle_bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `numel` elements: the smallest idle one that fits and is
        at most twice the size (shards come in a few sizes), else a new one."""
        nbytes = numel * dtype.itemsize
        fits = [(buf.numel(), i) for i, buf in enumerate(self._idle)
                if nbytes <= buf.numel() <= 2 * nbytes and _unshared(buf)]
        if fits:
            _, i = min(fits)
            buf = self._idle.pop(i)
            self._uncharge(buf.numel())
            self._lent[buf.data_ptr()] = buf
            return buf[:nbytes].view(dtype)
        return aligned_tensor(numel, dtype)

    def give(self, tensor: torch.Tensor) -> None:
        buf = self._lent.pop(tensor.data_ptr(), None)
        if buf is None:
            buf = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
        if buf.numel() == 0 or buf.numel() > self.max_bytes or buf.data_ptr() % ALIGN:
            return
        while self._idle and self.idle_bytes + buf.numel() > self.max_bytes:
            self._uncharge(self._idle.pop(0).numel())
        if self._charge is not None:
            self._charge(buf.numel())
        self._idle.append(buf)
        self.idle_bytes += buf.numel()

    def forget(self, tensor: torch.Tensor) -> None:
        """A buffer taken and never to be given back (lent on to autograd): the cache lets
        go of it, so it is freed when its last user lets go, not kept here for ever."""
        self._lent.pop(tensor.data_ptr(), None)

    def clear(self) -> None:
        self._lent.clear()
        while self._idle:
            self._uncharge(self._idle.pop().numel())

    def _uncharge(self, nbytes: int) -> None:
        self.idle_bytes -= nbytes
        if self._credit is not None:
            self._credit(nbytes)


def _unshared(buf: torch.Tensor) -> bool:
    # References to the storage: the tensor in the cache, and the Python
    # storage object made to ask. More means a view or a request holds it.
    storage = buf.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) <= 2
