"""`offload report`: what this install is and what it will use.

Gathers facts from each component (each owns the answer about itself) so a
bug report carries everything needed to reproduce: versions, the torch build,
CUDA, whether the native extension loaded, the SIMD level detected and the
one in use, kernel threads, the asynchronous I/O backends available, and the
device layer in use (cpu, cuda or sim).

First it imports every runtime dependency (offload/requirements.py, the list
setup.py installs): a missing or broken one fails the report, exit 1, naming
the package and the pip line, rather than a healthy-looking report in a
Python where training then crashes. Nothing here imports torch before that
check, so the report works, and says so, when torch itself is missing.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import sys

import offload
from offload.requirements import RUNTIME, Requirement


def import_problem(req: Requirement) -> str | None:
    """None when `req` imports here; otherwise why not, one line."""
    try:
        importlib.import_module(req.module)
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything, not only ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def _installed_version(req: Requirement) -> str | None:
    try:
        return importlib.metadata.version(req.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_missing(req: Requirement) -> bool:
    """Not installed at all, or (for an essential one) installed but not importable."""
    problem = import_problem(req)
    if problem is None:
        return False
    return req.essential or _installed_version(req) is None


def dependencies() -> dict:
    """distribution -> its installed version, or what is wrong, for this platform's requirements."""
    out = {}
    for req in RUNTIME:
        if not req.applies():
            continue
        problem, version = import_problem(req), _installed_version(req)
        if problem is None:
            out[req.distribution] = version or "importable, not installed as a distribution"
        elif is_missing(req):
            out[req.distribution] = f"MISSING ({problem})"
        else:
            out[req.distribution] = f"{version}, unusable here ({problem}); only {req.used_for} needs it"
    return out


def missing_dependencies() -> list[Requirement]:
    return [r for r in RUNTIME if r.applies() and is_missing(r)]


def _io_backends() -> dict:
    try:
        from offload import aio
    except ImportError:
        return {}
    return aio.backend_report()


def _torch_release() -> str:
    """"tested" where torch is a supported, tested release; else why not (offload/torch_release.py)."""
    release = importlib.import_module("offload.torch_release")
    return release.torch_release_problem() or release.torch_release_untested() or "tested"


def collect() -> dict:
    import torch

    from offload import _native, device, simd

    try:
        simd_used = simd.selected_level()
    except ValueError as exc:  # a bad OFFLOAD_SIMD: show it rather than fail the report
        simd_used = f"error: {exc}"
    return {
        "offload": offload.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_release": _torch_release(),
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "device_layer": device.describe_selection(),  # OFFLOAD_DEVICE (Note [device layer])
        "native_extension": "loaded" if _native.available() else f"missing ({_native.IMPORT_ERROR})",
        "features": {
            "cpu_adam": "native" if _native.available() else "pure-PyTorch fallback",
        },
        "simd_detected": simd.detected_level(),
        "simd_used": simd_used,
        "simd_override": os.environ.get(simd.ENV_VAR, "(unset)"),
        "adam_sqrt": importlib.import_module("offload.ops.adam").describe_sqrt_source(),  # Note [bitwise torch order]
        "adam_equals": importlib.import_module("offload.ops.adam").describe_reference(),
        "threads": simd.num_threads(),
        "cpu_count": os.cpu_count(),
        # This rank's share of its host under a launcher (Note [the node's share]).
        "node": importlib.import_module("offload.node").node_view(),
        "io_backends": _io_backends(),
        "dependencies": dependencies(),
    }


def explain_missing(missing: list[Requirement]) -> str:
    lines = [f"offload: {len(missing)} runtime dependenc{'y is' if len(missing) == 1 else 'ies are'} "
             "missing or broken in this Python (" + sys.executable + "):"]
    for req in missing:
        lines.append(f"  {req.distribution}: {import_problem(req)}; offload needs it for {req.used_for}")
    pip = " ".join(repr(r.pip_line()) if " " in r.pip_line() or ">" in r.pip_line() else r.pip_line()
                   for r in missing)
    lines.append(f"  install: pip install {pip}   (or reinstall offload: pip install -e .)")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    missing = missing_dependencies()
    if missing:
        if as_json:
            print(json.dumps({"offload": offload.__version__, "python": platform.python_version(),
                              "executable": sys.executable, "dependencies": dependencies()}, indent=2))
        print(explain_missing(missing), file=sys.stderr)
        return 1
    info = collect()
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "(none)"
        elif isinstance(value, list):
            value = ", ".join(value) or "(none)"
        print(f"{key:<{width}}  {value}")
    return 0
