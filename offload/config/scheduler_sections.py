"""The scheduler section (docs/CONFIG.md): WarmupLR, WarmupDecayLR and
WarmupCosineLR with their params, validated when built; offload/schedulers.py
runs them. Re-exported by offload/config/sections.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Mapping

from offload.config.base import (ConfigError, SchedulerType, WarmupType, _check_keys, _enum, _float, _int,
                                 _join, _Section)

# --------------------------------------------------------------------------- scheduler

def _check_warmup(obj, path: str) -> None:
    k = lambda name: _join(path, name)  # noqa: E731
    # 0 as DeepSpeed takes it (what Hugging Face's Trainer fills in without warmup): its
    # schedulers, and ours, warm up over max(2, warmup_num_steps) steps.
    obj._set("warmup_num_steps", _int(k("warmup_num_steps"), obj.warmup_num_steps, lo=0))
    obj._set("warmup_type", _enum(k("warmup_type"), obj.warmup_type, WarmupType))


@dataclass(frozen=True, kw_only=True)
class WarmupLRParams(_Section):
    """WarmupLR: from warmup_min_lr to warmup_max_lr over warmup_num_steps, then constant.

    warmup_max_lr None means the optimizer's lr (DeepSpeed 0.19.8 does the same).
    """

    SECTION: ClassVar[str] = "scheduler.params"
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None
    warmup_num_steps: int = 1000
    warmup_type: WarmupType = WarmupType.LOG

    def __post_init__(self):
        k = self._key
        self._set("warmup_min_lr", _float(k("warmup_min_lr"), self.warmup_min_lr, lo=0.0, hf_auto=True))
        self._set("warmup_max_lr", _float(k("warmup_max_lr"), self.warmup_max_lr, lo=0.0, none=True,
                                          hf_auto=True))
        _check_warmup(self, self.SECTION)


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRParams(_Section):
    """WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    SECTION: ClassVar[str] = "scheduler.params"
    total_num_steps: int
    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 0.001
    warmup_num_steps: int = 1000
    warmup_type: WarmupType = WarmupType.LOG

    def __post_init__(self):
        k = self._key
        self._set("total_num_steps", _int(k("total_num_steps"), self.total_num_steps, lo=1))
        self._set("warmup_min_lr", _float(k("warmup_min_lr"), self.warmup_min_lr, lo=0.0, hf_auto=True))
        self._set("warmup_max_lr", _float(k("warmup_max_lr"), self.warmup_max_lr, lo=0.0, hf_auto=True))
        _check_warmup(self, self.SECTION)


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLRParams(_Section):
    """WarmupCosineLR: a ratio of the optimizer's lr, from warmup_min_ratio to 1 over
    warmup_num_steps, then a cosine down to cos_min_ratio at total_num_steps."""

    SECTION: ClassVar[str] = "scheduler.params"
    total_num_steps: int
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: WarmupType = WarmupType.LOG

    def __post_init__(self):
        k = self._key
        self._set("total_num_steps", _int(k("total_num_steps"), self.total_num_steps, lo=1))
        self._set("warmup_min_ratio", _float(k("warmup_min_ratio"), self.warmup_min_ratio, lo=0.0, hi=1.0))
        self._set("cos_min_ratio", _float(k("cos_min_ratio"), self.cos_min_ratio, lo=0.0, hi=1.0))
        _check_warmup(self, self.SECTION)


_SCHEDULER_PARAMS = {
    SchedulerType.WARMUP_LR: WarmupLRParams,
    SchedulerType.WARMUP_DECAY_LR: WarmupDecayLRParams,
    SchedulerType.WARMUP_COSINE_LR: WarmupCosineLRParams,
}


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(_Section):
    """`scheduler`: {"type": ..., "params": {...}}; params checked for the type."""

    SECTION: ClassVar[str] = "scheduler"
    type: SchedulerType
    params: WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | None = None

    def __post_init__(self):
        kind = _enum("scheduler.type", self.type, SchedulerType)
        self._set("type", kind)
        cls = _SCHEDULER_PARAMS[kind]
        params = self.params
        if params is None or isinstance(params, Mapping):
            params = dict(params or {})
            _check_keys("scheduler.params", params, cls._accepted())
            required = [f.name for f in dataclasses.fields(cls)
                        if f.default is dataclasses.MISSING and f.name not in params]
            if required:
                raise ConfigError(f"scheduler.params.{required[0]}: missing (required by {kind.value})")
            params = cls(**params)
        if not isinstance(params, cls):
            raise ConfigError(f"scheduler.params: a {type(params).__name__} does not go with type {kind.value}")
        self._set("params", params)

    @classmethod
    def from_dict(cls, d: Mapping | None):
        if d is None:
            return None
        _check_keys("scheduler", d, ["type", "params"])
        if "type" not in d:
            raise ConfigError("scheduler.type: missing (accepted: " + ", ".join(t.value for t in SchedulerType) + ")")
        return cls(type=d["type"], params=d.get("params"))


