"""Loads the native extension (offload._C) and tracks which features fall back.

Every feature that has a native kernel also has a pure-PyTorch path. When the
extension is missing (no compiler at install time) the feature still works,
slower, and warns once; `offload report` lists each feature's path.
"""
from __future__ import annotations

import threading
import warnings

try:
    from offload import _C as native  # type: ignore[attr-defined]

    IMPORT_ERROR: str | None = None
except ImportError as exc:  # built without a compiler, or a broken build
    native = None
    IMPORT_ERROR = str(exc)

_warned: set[str] = set()
_lock = threading.Lock()


def available() -> bool:
    return native is not None


def warn_fallback(feature: str) -> None:
    """Warns once per feature that the pure-PyTorch path is in use."""
    with _lock:
        if feature in _warned:
            return
        _warned.add(feature)
    warnings.warn(
        f"offload: native extension unavailable ({IMPORT_ERROR}); {feature} uses the "
        "pure-PyTorch fallback, which is slower. Reinstall with a C++ compiler "
        "(`pip install -e .`) to build it.",
        RuntimeWarning,
        stacklevel=3,
    )
