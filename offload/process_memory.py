"""What the OS says the process holds, next to what the engine accounts for.

Note [engine bytes and the OS]
`MemoryAccount` counts the bytes the engine allocates per tier. The OS counts
resident pages. The two agree (docs/ARCHITECTURE.md, "Memory budget") when
three things are taken out of the process RSS:
  - what was resident before the engine existed: `ProcessMemory` takes the
    RSS when the Engine starts, after importing what the engine's
    construction would import anyway (torch.optim.Optimizer.__init__ imports
    torch._dynamo, about 70 MiB of RSS with sympy, on its first use);
  - the model's own parameter storages: the engine takes them over (moves
    each value home and drops the original), so they leave the baseline;
  - memory freed but kept by glibc malloc. Tensors under the dynamic mmap
    threshold (which glibc raises up to 32 MiB after a large block is freed)
    come from the heap, and freed heap chunks stay resident until trimmed.
    The engine calls `release_free_host_memory()` (malloc_trim) after
    initialize, where it has just freed the build's temporaries, and before
    it reads the RSS for `memory_report()`, so that figure follows what is
    live. With an NVMe tier, large allocations are mapped on their own
    (`map_large_allocations`), so freeing one returns it at once. After each
    step only when a tier is NVMe: pages handed back come
    back zeroed through a page fault each on the next step's first touch,
    which cost 10% of a 1.4 s step with everything on the host (GPT 67M, 2
    cores), while a disk-bound step hides it and the trim kept its peak RSS
    50-75 MiB lower (0.91 vs 0.97 GiB, same model on NVMe).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys

import psutil
import torch

from offload.accounting import MemoryAccount
from offload.tiers import Tier


@functools.lru_cache(maxsize=1)
def _glibc():
    """The C library when it has glibc's malloc_trim, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim"):
        return None  # musl and others: no malloc_trim
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
LARGE_ALLOCATION_BYTES = 8 << 20


def map_large_allocations() -> bool:
    """Serves allocations of 8 MiB and more from their own mappings, so that
    freeing one returns its pages to the OS at once (glibc mallopt).

    Called when a tier is NVMe, where host memory is what the run is short
    of. glibc's default threshold starts at 128 KiB and rises to 32 MiB as
    large blocks are freed, after which activations come from the heap and
    stay resident when freed, until the next trim: at the end of backward
    they sat beside the optimizer's buffers. The cost is a page fault per
    page of each mapped allocation, taken by the compute threads. GPT 67M on
    NVMe, same build, nvme contender alone, median step / peak RSS:
    1 MiB 2.17-2.29 s / 0.74-0.75 GiB; 8 MiB 1.98-2.14 s / 0.82-0.84 GiB;
    16 MiB 1.84-2.08 s / 0.86-0.90 GiB; 32 MiB (the dynamic maximum) 1.95 s
    / 0.89 GiB. 8 MiB keeps the large activations (the MLP's, the logits)
    and the gradients of the large weights returning at once, and serves
    the many smaller ones from the heap without a fault each time.
    Process-wide and kept after the engine closes (glibc cannot go back to
    the dynamic threshold). Returns whether it could be set."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))


def release_free_host_memory() -> bool:
    """Returns heap memory that malloc holds free to the OS (glibc malloc_trim).

    Returns whether anything could be asked of the allocator. Costs a walk of
    the free lists (40 us measured with 100 MiB free); the pages come back
    zeroed on their next use."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """The process's peak RSS: VmHWM (which reset_peak_rss() resets), else ru_maxrss."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # macOS reports bytes


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); returns whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def parameter_storage_bytes(model: torch.nn.Module) -> int:
    """Host bytes of the model's parameter storages, each storage once (tied weights)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        if p.device.type != "cpu":
            continue
        storage = p.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _import_lazy_dependencies() -> None:
    # The engine's own modules imported on demand: their one-time cost goes
    # before the baseline instead of into the engine's share. Not torch._dynamo,
    # which torch.optim.Optimizer's wrapped methods import on first call (70
    # MiB): the engine's optimizer does without it (ShardedAdam.add_param_group).
    import offload.aio.swap_store  # noqa: F401
    import offload.transfers.nvme_home  # noqa: F401
    import offload.schedulers  # noqa: F401


class ProcessMemory:
    """The OS view of one engine: RSS against a baseline taken when it started."""

    def __init__(self, baseline_rss: int, model_bytes: int):
        self.baseline_rss = baseline_rss
        self.model_bytes = model_bytes

    @classmethod
    def at_start(cls, model: torch.nn.Module) -> "ProcessMemory":
        """Baseline at Engine construction: RSS after the lazy imports, less the
        model's parameter storages (Note [engine bytes and the OS])."""
        _import_lazy_dependencies()
        model_bytes = parameter_storage_bytes(model)
        return cls(rss_bytes() - model_bytes, model_bytes)

    def report(self, account: MemoryAccount, device: torch.device) -> dict[str, int | None]:
        """rss/peak_rss: the OS's figures now. engine_bytes: the host tier as
        accounted, plus the device tier when `device` is the CPU (a CPU-only
        host). unaccounted: rss - baseline_rss - engine_bytes."""
        release_free_host_memory()  # freed heap chunks are not the engine's
        rss = rss_bytes()
        engine_bytes = account.usage(Tier.HOST).now
        if device.type == "cpu":
            engine_bytes += account.usage(Tier.DEVICE).now
        return {
            "rss": rss,
            "peak_rss": peak_rss_bytes(),
            "baseline_rss": self.baseline_rss,
            "model_bytes_taken_over": self.model_bytes,
            "engine_bytes": engine_bytes,
            "unaccounted": rss - self.baseline_rss - engine_bytes,
        }
