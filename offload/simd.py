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


def num_threads(requested: int | None = None) -> int:
    """Kernel threads: `requested` if given, else torch.get_num_threads()."""
    if requested is None:
        return torch.get_num_threads()
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"num_threads must be a positive int, got {requested!r}")
    return requested
