"""`offload report`: what this install is and what it will use.

Gathers facts from each component (each owns the answer about itself) so a
bug report carries everything needed to reproduce: versions, the torch build,
CUDA, whether the native extension loaded, the SIMD level detected and the
one in use, kernel threads, and the asynchronous I/O backends available.
"""
from __future__ import annotations

import json
import os
import platform

import torch

import offload
from offload import _native, simd


def _io_backends() -> dict:
    try:
        from offload import aio
    except ImportError:
        return {}
    return aio.backend_report()


def collect() -> dict:
    try:
        simd_used = simd.selected_level()
    except ValueError as exc:  # a bad OFFLOAD_SIMD: show it rather than fail the report
        simd_used = f"error: {exc}"
    return {
        "offload": offload.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "native_extension": "loaded" if _native.available() else f"missing ({_native.IMPORT_ERROR})",
        "features": {
            "cpu_adam": "native" if _native.available() else "pure-PyTorch fallback",
        },
        "simd_detected": simd.detected_level(),
        "simd_used": simd_used,
        "simd_override": os.environ.get(simd.ENV_VAR, "(unset)"),
        "threads": simd.num_threads(),
        "cpu_count": os.cpu_count(),
        "io_backends": _io_backends(),
    }


def main(as_json: bool = False) -> int:
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
