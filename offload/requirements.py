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


RUNTIME: tuple[Requirement, ...] = (
    # torch: any release >= 2.1; CI and the README install 2.13.0 first, so
    # pip never downloads another build.
    Requirement("torch", "torch", ">=2.1", "tensors and autograd"),
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
