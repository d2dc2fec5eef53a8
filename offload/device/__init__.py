"""The device layer: every device allocation, host<->device copy, stream, event
and pinned buffer goes through one `DeviceLayer` (Note [device layer] in
device/layer.py). The engine and `offload.init` each take theirs from
`from_env()`, and nothing else decides where compute runs (Note [one device
choice]).

`from_env()` picks the implementation: `OFFLOAD_DEVICE=cuda|sim|cpu`; unset is
cuda where CUDA exists, else cpu; the simulator only when asked for, with
`OFFLOAD_SIM_SEED` (an integer, default 0), `OFFLOAD_SIM_GBPS` (host<->device
bandwidth in GB/s, default 25), and `OFFLOAD_SIM_TFLOPS` with
`OFFLOAD_SIM_DEVICE_GBPS` (the modeled compute rate and device memory
bandwidth; unset or 0: compute takes the host's time; Note [sim modeled
compute] in device/sim_compute.py), and `OFFLOAD_SIM_POISON=0` (for timing:
no poison written into fresh memory and unfinished copies; the stream-order
checks stay).
"""
from __future__ import annotations

import os

import torch

from offload.device.layer import DeviceCounters, DeviceLayer, Event, Stream

ENV_DEVICE = "OFFLOAD_DEVICE"
ENV_SIM_SEED = "OFFLOAD_SIM_SEED"
ENV_SIM_GBPS = "OFFLOAD_SIM_GBPS"
ENV_SIM_TFLOPS = "OFFLOAD_SIM_TFLOPS"
ENV_SIM_DEVICE_GBPS = "OFFLOAD_SIM_DEVICE_GBPS"
ENV_SIM_POISON = "OFFLOAD_SIM_POISON"
LAYERS = ("cuda", "sim", "cpu")

__all__ = ["DeviceCounters", "DeviceLayer", "Event", "Stream", "from_env", "selected_name", "make",
           "collective_backend"]

# Note [one device choice]
# Where a rank computes is decided once, here: `selected_name()` reads
# OFFLOAD_DEVICE (unset: cuda where CUDA exists, else cpu) and `from_env()`
# builds that layer; its `device` is the compute device. The engine, offload.init
# (whose shards the engine adopts, with the builder's layer: one layer per run)
# and init_distributed's default backend all follow it, so OFFLOAD_DEVICE=cpu or
# sim on a machine with a GPU runs entirely on that layer. Code past this point
# asks the layer what it can do (`separate_memory`, `page_locks`, its streams),
# never its name or a tensor's device type, so the sim takes every path cuda
# takes; the one exception is where the bytes physically are (the native Adam
# reads host memory only: sharded_adam.py).


def selected_name() -> str:
    """The layer `from_env()` builds, without building it."""
    value = os.environ.get(ENV_DEVICE, "").strip().lower()
    if not value:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value not in LAYERS:
        raise ValueError(f"{ENV_DEVICE}={os.environ[ENV_DEVICE]!r}: expected one of "
                         f"{', '.join(LAYERS)} (or unset: cuda where CUDA exists, else cpu)")
    return value


def _env_number(var: str, kind: type, default, expected: str, zero_ok: bool = False):
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or (kind is float and not (value > 0 or (zero_ok and value == 0))):
        raise ValueError(f"{var}={raw!r}: expected {expected}")
    return value


def local_rank_gpu() -> int | None:
    """This rank's GPU: torchrun's LOCAL_RANK where set, else None (the current device)."""
    raw = os.environ.get("LOCAL_RANK", "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r}: expected an integer (torchrun sets it)") from None


def make(name: str) -> DeviceLayer:
    if name == "cuda":
        from offload.device.cuda import CudaDevice
        return CudaDevice(index=local_rank_gpu())
    if name == "sim":
        from offload.device.sim import DEFAULT_GBPS, SimDevice
        from offload.device.sim_compute import ComputeRate
        compute = ComputeRate(  # Note [sim modeled compute]; unset or 0: not modeled
            tflops=_env_number(ENV_SIM_TFLOPS, float, 0.0, "a number of TFLOP/s >= 0", zero_ok=True),
            device_gbps=_env_number(ENV_SIM_DEVICE_GBPS, float, 0.0, "a number of GB/s >= 0", zero_ok=True))
        poison = os.environ.get(ENV_SIM_POISON, "1").strip()
        if poison not in ("0", "1"):
            raise ValueError(f"{ENV_SIM_POISON}={poison!r}: expected 1 (default: unfinished copies' "
                             "destinations hold the poison pattern) or 0 (not filled: for timing)")
        return SimDevice(seed=_env_number(ENV_SIM_SEED, int, 0, "an integer"),
                         gbps=_env_number(ENV_SIM_GBPS, float, DEFAULT_GBPS, "a number of GB/s > 0"),
                         compute=compute, poison_memory=poison == "1")
    if name == "cpu":
        from offload.device.cpu import CpuDevice
        return CpuDevice()
    raise ValueError(f"device layer {name!r}: expected one of {', '.join(LAYERS)}")


def from_env() -> DeviceLayer:
    """The layer this process uses (see the module docstring); cuda on this rank's GPU."""
    return make(selected_name())


def collective_backend() -> str:
    """torch.distributed's backend for the selected layer: nccl between GPUs, else gloo."""
    return "nccl" if selected_name() == "cuda" else "gloo"


def describe_selection() -> str:
    """One line for `offload report`: the layer from_env() gives, or why it cannot."""
    try:
        layer = from_env()
    except (ValueError, RuntimeError) as exc:
        return f"error: {exc}"
    try:
        return layer.describe()
    finally:
        layer.close()
