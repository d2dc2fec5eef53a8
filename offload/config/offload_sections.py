"""zero_optimization's offload_param and offload_optimizer sections: where parameters and
optimizer state live ("none", "cpu", "nvme" or "auto"), and the keys that go with NVMe."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from offload.config.base import AUTO, ConfigError, _bool, _fail, _float, _int, _Section, _show, _tier
from offload.tiers import Tier, grad_tier_of


# Note [pin_memory]
# Page-locked (pinned) host memory is what a GPU copies from asynchronously
# and at full speed, and memory the OS can never page out. On a CPU-only host
# nothing is pinned whatever the keys say (offload.aio.memory.pins); the
# simulated device (OFFLOAD_DEVICE=sim) tracks as pinned what CUDA would pin.
# offload_param.pin_memory (default true: pinned when CUDA exists; DeepSpeed's
# default is false) decides for the parameter side: the staging pool between
# NVMe and the device (Note [staging pool] in offload/aio/buffer_pool.py),
# host homes of offload_param cpu (offload.aio.memory.pin_host_home) and the
# upload buffers of device homes' new values (Note [copy streams]). false:
# nothing of it is pinned. memory.pinned_budget bounds all of it, and the
# gradient pool and checkpoint inputs' pool too: the pools are made within it
# (refused at initialize when one cannot be; the staging pool needs
# MIN_STAGING_DEPTH of the largest partition) and a host home is pinned only
# while it fits.
# Not yet chosen by a key: the optimizer's own host buffers (the swap stores'
# staging, gathered buffers), pinned whenever CUDA is present; so
# offload_optimizer.pin_memory and cpu_offload_use_pin_memory change nothing.
PIN_MEMORY_INERT = ("the optimizer's host I/O buffers are pinned whenever CUDA is present, whatever this key "
               "says, and a CPU-only host pins nothing (offload_param.pin_memory does decide for parameters)")
_OFFLOAD_OPTIMIZER_INERT = {
    "pin_memory": PIN_MEMORY_INERT,
    "pipeline_read": "NVMe reads of optimizer state are always pipelined",
    "pipeline_write": "NVMe writes of optimizer state are always pipelined",
    "pipeline": "NVMe reads and writes of optimizer state are always pipelined",
    "fast_init": "optimizer state files are always created empty and filled by the first write",
    "ratio": "partial optimizer offload (ZeRO-Offload++) is not implemented: all of it is offloaded",
    "super_offload": "SuperOffload is not implemented: the offloaded step runs on the CPU Adam",
}


class _OffloadSection(_Section):
    """offload_param and offload_optimizer: `device` may be "auto" (held as `auto`);
    `unused`: (dotted key, why) for the NVMe keys given beside another device."""

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.auto:
            out["device"] = "auto"
        return out


def _check_offload(obj, nvme_only: tuple[str, ...]) -> None:
    """device (DeepSpeed's "none", "cpu", "nvme": a Tier), nvme_path, and the keys
    that only mean something for NVMe: beside another device (a shared config
    that keeps its nvme_path while "device" says "cpu") each is dropped and
    named once at initialize as having no effect (`unused`)."""
    k = obj._key
    if obj.device is AUTO or obj.device == "auto":
        # Note [automatic placement] (offload/placement.py): the planner picks each
        # parameter's tier at initialize; gradients wait on the host meanwhile.
        obj._set("auto", True)
        obj._set("device", Tier.HOST)
    else:
        obj._set("device", _tier(k("device"), obj.device))
    if obj.nvme_path is not None:
        if not isinstance(obj.nvme_path, (str, os.PathLike)) or str(obj.nvme_path) == "":
            raise _fail(k("nvme_path"), obj.nvme_path, "a directory path")
        obj._set("nvme_path", Path(obj.nvme_path))
    if obj.device is Tier.NVME and obj.nvme_path is None:
        raise ConfigError(f"{k('nvme_path')}: required when {k('device')} is 'nvme'")
    unused = []
    for name in nvme_only:
        value = getattr(obj, name)
        if value is not None and obj.device is not Tier.NVME and not obj.auto:
            unused.append((k(name), f"{_show(value)} has no effect: it is used only when {k('device')} is "
                                    f"'nvme' or 'auto' (it is {_show(obj.device)})"))
            obj._set(name, None)
    obj._set("unused", tuple(unused))


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig(_OffloadSection):
    """`zero_optimization.offload_param`: where the compute-precision parameter shards live.

    buffer_count, buffer_size (elements) and max_in_cpu (elements) are optional: by
    default the engine sizes them from the model and the prefetch depth.
    pin_memory: whether parameter staging buffers and host homes are pinned when CUDA
    exists (Note [pin_memory]).
    """

    SECTION: ClassVar[str] = "zero_optimization.offload_param"
    device: Tier = Tier.DEVICE
    # "device": "auto" (Note [automatic placement]): set from `device`, not a key of its own.
    auto: bool = False
    unused: tuple = field(default=(), compare=False, repr=False)
    NOT_KEYS: ClassVar[tuple] = ("auto", "unused")
    nvme_path: Path | None = None
    buffer_count: int | None = None
    buffer_size: int | None = None
    max_in_cpu: int | None = None
    pin_memory: bool = True

    def __post_init__(self):
        k = self._key
        _bool(k("pin_memory"), self.pin_memory)
        self._set("buffer_count", _int(k("buffer_count"), self.buffer_count, lo=1, none=True))
        self._set("buffer_size", _int(k("buffer_size"), self.buffer_size, lo=1, none=True))
        self._set("max_in_cpu", _int(k("max_in_cpu"), self.max_in_cpu, lo=0, none=True))
        _check_offload(self, ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu"))


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig(_OffloadSection):
    """`zero_optimization.offload_optimizer`: where fp32 masters and Adam moments live."""

    SECTION: ClassVar[str] = "zero_optimization.offload_optimizer"
    INERT: ClassVar[dict] = _OFFLOAD_OPTIMIZER_INERT
    device: Tier = Tier.DEVICE
    auto: bool = False  # "device": "auto", as offload_param's
    unused: tuple = field(default=(), compare=False, repr=False)
    NOT_KEYS: ClassVar[tuple] = ("auto", "unused")
    nvme_path: Path | None = None
    buffer_count: int | None = None
    # DeepSpeed's key (SuperOffload's there): the share of this process's cores
    # the CPU Adam runs on while it overlaps backward. null: every core but one
    # beside a separate device, one beside a CPU backward (Note [optimizer
    # threads] in offload/simd.py).
    cpuadam_cores_perc: float | None = None
    # Ours: whether optimizer updates run beside backward and the next forward (in backward,
    # deferred, carried: Note [update names] in offload/step/update_policy.py). null: as
    # zero_optimization.overlap_comm, DeepSpeed's gradient-reduction overlap, which turned
    # them on before this key existed.
    overlap_updates: bool | None = None

    def __post_init__(self):
        if self.overlap_updates is not None:
            _bool(self._key("overlap_updates"), self.overlap_updates)
        self._set("buffer_count", _int(self._key("buffer_count"), self.buffer_count, lo=1, none=True))
        self._set("cpuadam_cores_perc", _float(self._key("cpuadam_cores_perc"), self.cpuadam_cores_perc,
                                               lo=0.0, hi=1.0, lo_open=True, none=True))
        _check_offload(self, ("nvme_path", "buffer_count"))

    @property
    def grad_tier(self) -> Tier:
        """Where fp32 gradient partitions wait for the optimizer (`grad_tier_of`; an
        auto side's nominal tier is the host: its plan sets each shard's)."""
        return grad_tier_of(self.device)
