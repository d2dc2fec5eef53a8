"""What offload needs at run time: one list, read by setup.py (install_requires)
and by `offload report` (which checks each one is importable in this Python).

This module imports nothing, so setup.py can load it without importing offload
(and so without torch). Each entry names the distribution, the module it
provides, the version range, and what offload uses it for.
"""
from __future__ import annotations

import sys
from typing import NamedTuple


class Requirement(NamedTuple):
    distribution: str      # the name pip installs
    module: str            # the name `import` takes
    specifier: str         # version range, PEP 440 ("" for any)
    used_for: str
    linux_only: bool = False
    # False: offload runs without it (another backend takes over); it still must be
    # installed, as setup.py promised, but failing to import (py-libaio without the
    # system's libaio.so.1) is a note in `offload report`, not a failure.
    essential: bool = True

    def pip_line(self) -> str:
        line = self.distribution + self.specifier
        return f'{line}; sys_platform == "linux"' if self.linux_only else line

    def applies(self) -> bool:
        """Whether this platform needs it (the marker of `pip_line`, evaluated here)."""
        return not self.linux_only or sys.platform == "linux"


# The torch releases the test suite runs on, oldest first: the one list that
# the supported range (TORCH_SPECIFIER), offload.torch_release's run-time check
# and its message follow. A release is added here when the suite passes on it.
TORCH_TESTED: tuple[str, ...] = ("2.11.0", "2.13.0", "2.14.1")


def _minor(release: str) -> tuple[int, int]:
    major, minor = release.split(".")[:2]
    return int(major), int(minor)


# (major, minor) of the oldest and newest tested releases: the supported range,
# both ends included, any patch release of them (2.12 lies between, untested).
TORCH_OLDEST = _minor(TORCH_TESTED[0])
TORCH_NEWEST = _minor(TORCH_TESTED[-1])
# ">=2.11": pip refuses what is known not to work (2.10 and older: untested,
# and 2.11 was the first to need Note [recompute across torch releases]). No
# upper bound: pip would downgrade a user's newer torch to reach the range, a
# download of gigabytes that may not match their CUDA driver. A release newer
# than TORCH_NEWEST is named at initialize as untested instead
# (offload/torch_release.py); the remedy is to test it and add it above.
TORCH_SPECIFIER = f">={TORCH_OLDEST[0]}.{TORCH_OLDEST[1]}"


RUNTIME: tuple[Requirement, ...] = (
    # torch: the tested range (TORCH_TESTED); CI and the README install a tested
    # release first, so pip never downloads another build.
    Requirement("torch", "torch", TORCH_SPECIFIER, "tensors and autograd"),
    Requirement("numpy", "numpy", ">=1.22",
                "the buffer protocol over tensor memory (checksums, file I/O, swap headers)"),
    Requirement("psutil", "psutil", "", "host memory and RSS figures"),
    Requirement("tqdm", "tqdm", "", "progress bars (consolidation, the fine-tune example)"),
    Requirement("safetensors", "safetensors", "", "weights loaded tensor by tensor; consolidated checkpoints"),
    Requirement("libaio", "libaio", ">=0.9", "the `libaio` I/O backend (py-libaio)",
                linux_only=True, essential=False),
)


def install_requires() -> list[str]:
    return [r.pip_line() for r in RUNTIME]
