"""The offload configuration: DeepSpeed's JSON where the concept is the same.

    cfg = Config.load("ds_config.json")      # or a dict, or a Config
    cfg = cfg.resolve_auto(hidden_size=4096, num_params=7e9, world_size=8)

Each section is a frozen, keyword-only dataclass validated once, when it is
built (from a dict or directly). Every error is a `ConfigError` naming the
full dotted key, the value and what is accepted. An unknown key is an error
with the closest accepted key. A DeepSpeed config loads unchanged: each of
its keys is honoured, mapped to ours, or accepted as having no effect here
(`Config.no_effect()` names those, and initialize logs them once), or, where
ignoring it would change the results, refused with the reason (Note
[DeepSpeed keys] in base.py). Nothing is silently ignored. docs/CONFIG.md
lists every key and what happens to it.

Note [strict values]: bool is not an int and "3" is not an int. A float with
no fractional part is accepted where an int is expected, because DeepSpeed
configs write sizes as `1e9` and JSON reads that as a float.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from offload.aio.config import AioConfig
from offload.config.activations import ActivationCheckpointingConfig
from offload.config.compile import CompileConfig
from offload.config.frozen import FrozenConfig
from offload.config.hf_autos import autos_message, trainer_autos
from offload.tiers import Tier
from offload.config.base import (AUTO, ConfigError, OptimizerType, Precision,
                                 SchedulerType, WarmupType, _apply_renames, _bool, _fail, _float,
                                 _int, _Section, _to_json, parse_bytes)
from offload.config.offload_sections import OffloadOptimizerConfig, OffloadParamConfig
from offload.config.scheduler_sections import (SchedulerConfig, WarmupCosineLRParams, WarmupDecayLRParams,
                                               WarmupLRParams)
from offload.config.sections import AioSection, BF16Config, FP16Config, MemoryConfig, OptimizerConfig, ZeroConfig

__all__ = [
    "AUTO", "ActivationCheckpointingConfig", "AioConfig", "BF16Config", "Config", "ConfigError", "FP16Config", "MemoryConfig",
    "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig",
    "OptimizerType", "Precision", "SchedulerConfig", "SchedulerType", "Tier", "WarmupCosineLRParams",
    "WarmupDecayLRParams", "WarmupLRParams", "WarmupType", "ZeroConfig", "parse_bytes",
]


# --------------------------------------------------------------------------- top level

_NOT_HERE_LOG = "offload does not log to it; log from the training script"
_TOP_REFUSED = {
    "amp": "NVIDIA apex AMP is not supported; use 'bf16' or 'fp16'",
    "elasticity": "elastic batch sizes are not implemented; give the batch sizes",
    "pipeline": "pipeline parallelism is not implemented",
    "tensor_parallel": "tensor parallelism is not implemented",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not implemented",
    "data_efficiency": "DeepSpeed's curriculum and data routing are not implemented",
    "compression_training": "compression training is not implemented",
}
_TOP_INERT = {
    "zero_allow_untested_optimizer": "the optimizer is always offload's Adam/AdamW",
    "zero_force_ds_cpu_optimizer": "the optimizer is always offload's Adam/AdamW",
    "prescale_gradients": "gradients are averaged once, after the reduce-scatter",
    "gradient_predivide_factor": "gradients are averaged once, after the reduce-scatter",
    "communication_data_type": "gradients are reduced in the compute dtype",
    "fp32_reduce_scatter": "gradients are reduced in the compute dtype",
    "data_types": "gradients are always accumulated in fp32",
    "sparse_gradients": "gradients are reduced dense",
    "disable_allgather": "parameters are always all-gathered per module",
    "seq_parallel_communication_data_type": "sequence parallelism is not implemented",
    "flops_profiler": _NOT_HERE_LOG,
    "tensorboard": _NOT_HERE_LOG,
    "wandb": _NOT_HERE_LOG,
    "csv_monitor": _NOT_HERE_LOG,
    "comet": _NOT_HERE_LOG,
    "comms_logger": _NOT_HERE_LOG,
    "memory_breakdown": "use 'offload estimate' and engine.memory_report()",
    "dump_state": "use engine.memory_report() and engine.timeline()",
    "checkpoint": "checkpoints are always complete-or-absent, per rank, and resume bit-exactly",
    "autotuning": "DeepSpeed's autotuner is a launcher of its own; offload sizes buffers from the model",
}
# Old DeepSpeed spellings of a key we read.
_TOP_RENAMED = {"bfloat16": "bf16"}

_SECTIONS = {"bf16": BF16Config, "fp16": FP16Config, "zero_optimization": ZeroConfig,
             "aio": AioSection, "memory": MemoryConfig,
             "activation_checkpointing": ActivationCheckpointingConfig, "compile": CompileConfig,
             "frozen": FrozenConfig}


@dataclass(frozen=True, kw_only=True)
class Config(_Section):
    """The whole configuration. Build with `Config.load(...)`; see docs/CONFIG.md."""

    SECTION: ClassVar[str] = ""
    REFUSED: ClassVar[dict] = _TOP_REFUSED
    INERT: ClassVar[dict] = _TOP_INERT
    RENAMED: ClassVar[dict] = _TOP_RENAMED
    CHILDREN: ClassVar[dict] = {**_SECTIONS, "optimizer": OptimizerConfig}
    train_batch_size: Any = None
    train_micro_batch_size_per_gpu: Any = None
    gradient_accumulation_steps: Any = 1
    gradient_clipping: float = 0.0
    steps_per_print: int | None = None
    dataloader_drop_last: bool = False
    wall_clock_breakdown: bool = False
    bf16: BF16Config = field(default_factory=BF16Config)
    fp16: FP16Config = field(default_factory=FP16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    frozen: FrozenConfig = field(default_factory=FrozenConfig)
    # (dotted key, why) for each key of the source dict with no effect here;
    # filled by from_dict, read through no_effect(). Not a config key.
    inert: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        self._set("train_batch_size", _int("train_batch_size", self.train_batch_size, lo=1, auto=True, none=True))
        self._set("train_micro_batch_size_per_gpu",
                  _int("train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu,
                       lo=1, auto=True, none=True))
        self._set("gradient_accumulation_steps",
                  _int("gradient_accumulation_steps", self.gradient_accumulation_steps, lo=1, auto=True))
        self._set("gradient_clipping", _float("gradient_clipping", self.gradient_clipping, lo=0.0, hf_auto=True))
        self._set("steps_per_print", _int("steps_per_print", self.steps_per_print, lo=1, none=True))
        _bool("dataloader_drop_last", self.dataloader_drop_last)
        _bool("wall_clock_breakdown", self.wall_clock_breakdown)
        # Sections given as dicts (Config(aio={...}) as well as from_dict) name their
        # keys with no effect; from_dict then adds the top level's.
        given = {name: v for name, v in ((n, getattr(self, n)) for n in _SECTIONS) if isinstance(v, Mapping)}
        if given and not self.inert:
            self._set("inert", tuple(type(self).inert_keys(given)))
        for name, cls in _SECTIONS.items():
            v = getattr(self, name)
            kind = getattr(cls, "TYPE", cls)  # a section read into a type of its own layer (aio)
            if v is None or isinstance(v, Mapping):
                self._set(name, cls.from_dict(v))
            elif not isinstance(v, kind):
                raise _fail(name, v, f"a JSON object or {kind.__name__}")
        for name, cls in (("optimizer", OptimizerConfig), ("scheduler", SchedulerConfig)):
            v = getattr(self, name)
            if isinstance(v, Mapping):
                self._set(name, cls.from_dict(v))
            elif v is not None and not isinstance(v, cls):
                raise _fail(name, v, f"a JSON object, null or {cls.__name__}")
        if self.bf16.enabled and self.fp16.enabled:
            raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")

    # ---- construction

    @classmethod
    def from_dict(cls, d: Mapping) -> "Config":
        """From a DeepSpeed-style dict. Absent gradient_accumulation_steps with both batch sizes
        given is derived as DeepSpeed does (it becomes AUTO until `resolve_auto`)."""
        autos = trainer_autos(d) if isinstance(d, Mapping) else []
        if autos:  # Note [Hugging Face autos]: all at once, before any section is built
            raise ConfigError(autos_message(autos))
        raw, d = d, cls._fields_of(d)
        if ("gradient_accumulation_steps" not in d and isinstance(d.get("train_batch_size"), (int, float))
                and isinstance(d.get("train_micro_batch_size_per_gpu"), (int, float))):
            d["gradient_accumulation_steps"] = AUTO
        config = cls(**d)
        config._set("inert", tuple(cls.inert_keys(_apply_renames("", raw, cls.RENAMED))))
        return config

    @classmethod
    def _accepted(cls) -> list[str]:
        return [name for name in super()._accepted() if name != "inert"]

    def no_effect(self) -> list[tuple[str, str]]:
        """(dotted key, why) for each key given that has no effect here: inert keys of the
        source dict, and accepted keys set to a value offload does not act on."""
        return list(self.inert) + self.zero_optimization.value_notes()

    def no_effect_line(self) -> str | None:
        """One line for the log at initialize, or None when every key given takes effect."""
        notes = self.no_effect()
        if not notes:
            return None
        return ("config keys accepted with no effect here (DeepSpeed keys; docs/CONFIG.md): "
                + "; ".join(f"{key}: {why}" for key, why in notes))

    @classmethod
    def load(cls, source: "Mapping | str | os.PathLike | Config") -> "Config":
        """A Config (returned as is), a dict, or the path of a JSON file."""
        if isinstance(source, Config):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            try:
                text = path.read_text()
            except OSError as exc:
                raise ConfigError(f"config file {str(path)!r}: {exc.strerror or exc}") from None
            try:
                d = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"config file {str(path)!r}: invalid JSON at line {exc.lineno} "
                                  f"column {exc.colno}: {exc.msg}") from None
            if not isinstance(d, dict):
                raise ConfigError(f"config file {str(path)!r}: the top level is not a JSON object")
            try:
                return cls.from_dict(d)
            except ConfigError as exc:
                raise ConfigError(f"config file {str(path)!r}: {exc}") from None
        raise ConfigError(f"config: {type(source).__name__} is not a dict, a JSON file path or a Config")

    def to_dict(self) -> dict:
        """A DeepSpeed-style dict; `Config.from_dict(c.to_dict()) == c`."""
        out = super().to_dict()
        out.pop("inert", None)
        out["gradient_accumulation_steps"] = _to_json(self.gradient_accumulation_steps)
        return out

    def replace(self, **changes) -> "Config":
        """A copy with `changes` (section objects or values), checked like a loaded config."""
        return dataclasses.replace(self, **changes)

    # ---- derived

    @property
    def precision(self) -> Precision:
        """fp32, bf16 or fp16, from bf16.enabled and fp16.enabled (both on is an error)."""
        if self.bf16.enabled and self.fp16.enabled:
            raise ConfigError("bf16.enabled and fp16.enabled are both true; enable at most one")
        if self.bf16.enabled:
            return Precision.BF16
        if self.fp16.enabled:
            return Precision.FP16
        return Precision.FP32

    def has_auto(self) -> bool:
        """Whether any batch or bucket key is "auto" (Hugging Face's Trainer fills those in)."""
        z = self.zero_optimization
        return any(v is AUTO for v in (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                        self.gradient_accumulation_steps,
                                        *(getattr(z, n) for n in z.SIZES)))

    def resolve_auto(self, hidden_size: int | None, num_params: int, *, world_size: int = 1) -> "Config":
        """A copy with every AUTO replaced; see docs/CONFIG.md "auto values".

        From the model (DeepSpeed / HF semantics): reduce_bucket_size = hidden^2,
        stage3_prefetch_bucket_size = int(0.9 * hidden^2), stage3_param_persistence_threshold =
        10 * hidden; with hidden_size None, DeepSpeed's defaults. stage3_max_live_parameters,
        stage3_max_reuse_distance: DeepSpeed's defaults (1e9); sub_group_size: min(1e9, num_params).
        Batch sizes: DeepSpeed's rule train_batch_size = micro * accumulation * world_size
        derives the unknown one; a micro batch of 'auto' needs train_batch_size.
        """
        hidden_size = _int("resolve_auto: hidden_size", hidden_size, lo=1, none=True)
        num_params = _int("resolve_auto: num_params", num_params, lo=1)
        world_size = _int("resolve_auto: world_size", world_size, lo=1)
        tb, mb, gas = self._resolve_batch(world_size)
        return dataclasses.replace(self, train_batch_size=tb, train_micro_batch_size_per_gpu=mb,
                                   gradient_accumulation_steps=gas,
                                   zero_optimization=self.zero_optimization.resolve_auto(hidden_size, num_params))

    def resolve_batch(self, world_size: int) -> "Config":
        """A copy with the batch sizes DeepSpeed derives: any two of train_batch_size,
        train_micro_batch_size_per_gpu and gradient_accumulation_steps give the third
        (train_batch_size = micro * accumulation * world_size); values that disagree raise."""
        world_size = _int("resolve_batch: world_size", world_size, lo=1)
        tb, mb, gas = self._resolve_batch(world_size)
        return dataclasses.replace(self, train_batch_size=tb, train_micro_batch_size_per_gpu=mb,
                                   gradient_accumulation_steps=gas)

    def _resolve_batch(self, world_size: int):
        def known(v):
            return v if isinstance(v, int) else None

        tb, mb, gas = (known(self.train_batch_size), known(self.train_micro_batch_size_per_gpu),
                       known(self.gradient_accumulation_steps))
        if self.train_micro_batch_size_per_gpu is AUTO and tb is None:
            raise ConfigError("train_micro_batch_size_per_gpu: 'auto' needs train_batch_size to derive it "
                              "(train_batch_size = micro batch * gradient_accumulation_steps * world size)")
        if tb is not None and mb is not None and gas is not None:
            pass
        elif tb is not None and mb is not None:
            gas = self._divide("gradient_accumulation_steps", tb, mb * world_size, tb, mb, world_size)
        elif tb is not None and gas is not None:
            mb = self._divide("train_micro_batch_size_per_gpu", tb, gas * world_size, tb, gas, world_size)
        elif mb is not None and gas is not None:
            tb = mb * gas * world_size
        elif tb is not None:
            gas = 1
            mb = self._divide("train_micro_batch_size_per_gpu", tb, world_size, tb, 1, world_size)
        elif mb is not None:
            gas = 1
            tb = mb * world_size
        else:
            gas = gas if gas is not None else 1
        self._check_batch(tb, mb, gas, world_size)
        return tb, mb, gas

    @staticmethod
    def _divide(name, num, den, tb, other, world_size):
        if num % den:
            raise ConfigError(f"{name}: cannot be derived: train_batch_size {tb} is not divisible by "
                              f"{other} * world size {world_size}")
        return num // den

    @staticmethod
    def _check_batch(tb, mb, gas, world_size):
        if tb is not None and mb is not None and gas is not None and tb != mb * gas * world_size:
            raise ConfigError(
                f"train_batch_size: {tb} != train_micro_batch_size_per_gpu {mb} * gradient_accumulation_steps "
                f"{gas} * world size {world_size} (= {mb * gas * world_size})")

    def check_batch(self, world_size: int) -> None:
        """DeepSpeed's rule: train_batch_size == micro * accumulation * world_size, where all are given."""
        world_size = _int("check_batch: world_size", world_size, lo=1)

        def known(v):
            return v if isinstance(v, int) else None

        self._check_batch(known(self.train_batch_size), known(self.train_micro_batch_size_per_gpu),
                          known(self.gradient_accumulation_steps), world_size)
