"""Whether the torch in this Python is a release offload supports.

pip enforces `TORCH_SPECIFIER` (offload/requirements.py) when it installs
offload, but nothing stops torch being changed afterwards (`pip install
torch==...`, `--no-deps`, a source build on the path), and an untested
release fails far from the cause: 2.11's autograd broke activation
checkpointing in backward (Note [recompute across torch releases] in
activations/recompute.py). So `check_torch_release()`, at initialize and at
offload.init:
- refuses a torch older than the oldest tested release, naming it, the range
  and what to install instead;
- warns once about a torch newer than the newest tested release (it may well
  work: we cannot say it is exact until the suite has run on it). Refusing it
  would make every torch release a breaking change for users who upgrade
  first; pinning it in pip would download gigabytes to downgrade them.

The release is read from `torch.__version__` as major.minor: a local or
pre-release build of a supported minor (2.14.0a0+git..., 2.13.0+cu130) counts
as that minor, which is what its autograd is.
"""
from __future__ import annotations

import re
import warnings

from offload.requirements import TORCH_NEWEST, TORCH_OLDEST, TORCH_SPECIFIER, TORCH_TESTED

_warned: set[str] = set()


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _install_hint() -> str:
    return (f"`pip install torch=={TORCH_TESTED[-1]}` (or {' or '.join(TORCH_TESTED[:-1])}), "
            "in this environment or a fresh virtual environment")


def torch_release_problem() -> str | None:
    """Why the installed torch cannot be used, with what to do instead; None when it can."""
    import torch

    version = str(torch.__version__)
    minor = _minor(version)
    if minor is not None and minor >= TORCH_OLDEST:
        return None
    return (f"offload supports torch {TORCH_SPECIFIER} (tested: {', '.join(TORCH_TESTED)}); this Python has "
            f"torch {version}. Install a tested release, e.g. {_install_hint()}")


def torch_release_untested() -> str | None:
    """A note when the installed torch is newer than every tested release; None otherwise."""
    import torch

    version = str(torch.__version__)
    minor = _minor(version)
    if minor is None or minor <= TORCH_NEWEST:
        return None
    return (f"torch {version} is newer than every release offload is tested on ({', '.join(TORCH_TESTED)}): "
            "training runs, but parity with plain PyTorch is unverified there (activation checkpointing "
            f"leans on autograd internals that change between releases). For tested results: {_install_hint()}")


def check_torch_release() -> None:
    """Raises RuntimeError for a torch older than the supported range; warns once for
    one newer than every tested release (see the module's docstring)."""
    problem = torch_release_problem()
    if problem is not None:
        raise RuntimeError(problem)
    note = torch_release_untested()
    if note is not None and note not in _warned:
        _warned.add(note)
        warnings.warn(note, RuntimeWarning, stacklevel=3)
