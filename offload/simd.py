"""Which SIMD kernel the native code runs, and on how many threads.

The level is detected at run time from cpuid (never fixed at build time) and
can be lowered with the environment variable OFFLOAD_SIMD=scalar|avx2|avx512|auto,
read at each call so tests can force every path. Asking for a level the CPU
lacks is an error, not a silent downgrade.
"""
from __future__ import annotations

import os

import torch

from offload import _native

LEVELS = ("scalar", "avx2", "avx512")
ENV_VAR = "OFFLOAD_SIMD"


def detected_level() -> str:
    """Highest level this CPU supports ('scalar' without the extension)."""
    if _native.native is None:
        return "scalar"
    return _native.native.detected_simd_level()


def selected_level() -> str:
    """The level kernels use now: OFFLOAD_SIMD if set, else the detected one."""
    requested = os.environ.get(ENV_VAR, "auto").strip().lower()
    detected = detected_level()
    if requested in ("", "auto"):
        return detected
    if requested not in LEVELS:
        raise ValueError(
            f"{ENV_VAR}={requested!r} is not a SIMD level; expected one of "
            f"{', '.join(LEVELS)} or auto"
        )
    if LEVELS.index(requested) > LEVELS.index(detected):
        raise ValueError(
            f"{ENV_VAR}={requested!r} but this CPU supports at most {detected!r}"
        )
    return requested


def available_levels() -> list[str]:
    """Every level that can be forced on this CPU, lowest first."""
    return list(LEVELS[: LEVELS.index(detected_level()) + 1])


# Note [optimizer threads]
# While Adam overlaps backward (Note [optimizer overlap] in step/updates.py)
# the kernel shares the host with whatever drives the compute. Beside a device
# with memory of its own (a GPU; the sim stands in) the compute thread needs
# one core to launch kernels and feed copies, so Adam takes every other core
# of this process's CPU affinity (taskset, cgroups, a launcher's binding):
# one core was what the first GPU measurement found it using, 0.52 Gparam/s
# of the kernel's 2.9 on 16 cores. Beside a CPU backward, the backward itself
# has the cores: Adam takes one (measured on 2 cores: backward 0.79 s -> 1.06 s
# with Adam on both). offload_optimizer.cpuadam_cores_perc (DeepSpeed's key)
# sets the share instead: max(1, floor(share x cores)). After backward, the
# updates still to run take every core of this rank's share (Note [the node's
# share] in offload/node.py), not torch.get_num_threads(): torchrun sets
# OMP_NUM_THREADS=1 for every rank when it starts several.
def overlap_threads(cores_share: float | None, *, device_apart: bool, cores: int | None = None) -> int:
    """Adam kernel threads while updates overlap backward (Note [optimizer threads]); cores:
    this rank's share of the host's (Note [the node's share] in offload/node.py), default
    the process's CPU affinity."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores_share is not None:
        return max(1, int(cores_share * cores))
    return max(1, cores - 1) if device_apart else 1


def num_threads(requested: int | None = None) -> int:
    """Kernel threads: `requested` if given, else torch.get_num_threads()."""
    if requested is None:
        return torch.get_num_threads()
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"num_threads must be a positive int, got {requested!r}")
    return requested
