"""The config sections: precision (bf16, fp16), optimizer, zero_optimization,
aio, and our own memory budgets (the scheduler's: config/scheduler_sections.py;
offload_param and offload_optimizer: config/offload_sections.py). Each is
validated when built; see docs/CONFIG.md."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from offload.aio.config import AioConfig
from offload.config.base import (_HF_AUTO, AUTO, ConfigError, OptimizerType, _apply_renames, _bool,
                                 _check_keys, _enum, _fail, _float, _int, _join, _Section, _show,
                                 parse_bytes)
from offload.config.offload_sections import PIN_MEMORY_INERT, OffloadOptimizerConfig, OffloadParamConfig

# --------------------------------------------------------------------------- precision

_BF16_INERT = {
    "immediate_grad_update": "gradients always go to the optimizer's fp32 accumulation buffer as they "
                             "are produced; there is no deferred variant to choose",
    "check_grad_overflow": "bf16 training does not check for overflow (no loss scaling)",
    "bf16_master_weights_and_grads": "master weights and gradient accumulation are always fp32",
    "bf16_optimizer_states": "optimizer moments are always fp32",
}


@dataclass(frozen=True, kw_only=True)
class BF16Config(_Section):
    """`bf16`: compute in bfloat16, with fp32 master weights and moments."""

    SECTION: ClassVar[str] = "bf16"
    INERT: ClassVar[dict] = _BF16_INERT
    enabled: bool = False

    def __post_init__(self):
        _bool(self._key("enabled"), self.enabled, hf_auto=True)


_FP16_REFUSED = {
    "auto_cast": "offload does not autocast inputs; the model runs in the compute dtype",
    "consecutive_hysteresis": "not implemented; hysteresis counts overflows as DeepSpeed's default does",
}
_FP16_INERT = {
    "fp16_master_weights_and_grads": "master weights and gradient accumulation are always fp32",
}


@dataclass(frozen=True, kw_only=True)
class FP16Config(_Section):
    """`fp16`: compute in float16 with a loss scaler (DeepSpeed's keys and defaults).

    loss_scale: 0 means dynamic scaling starting at 2**initial_scale_power, halved on an
    overflow once `hysteresis` overflows have been seen, doubled after `loss_scale_window`
    steps without one, never below `min_loss_scale`. A positive value is a static scale.
    """

    SECTION: ClassVar[str] = "fp16"
    REFUSED: ClassVar[dict] = _FP16_REFUSED
    INERT: ClassVar[dict] = _FP16_INERT
    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    def __post_init__(self):
        k = self._key
        _bool(k("enabled"), self.enabled, hf_auto=True)
        self._set("loss_scale", _float(k("loss_scale"), self.loss_scale, lo=0.0))
        self._set("initial_scale_power", _int(k("initial_scale_power"), self.initial_scale_power, lo=0, hi=127))
        self._set("loss_scale_window", _int(k("loss_scale_window"), self.loss_scale_window, lo=1))
        self._set("hysteresis", _int(k("hysteresis"), self.hysteresis, lo=1))
        self._set("min_loss_scale", _float(k("min_loss_scale"), self.min_loss_scale, lo=0.0, lo_open=True))

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0.0


# --------------------------------------------------------------------------- optimizer

_OPTIMIZER_PARAMS_REFUSED = {
    "amsgrad": "AMSGrad is not implemented",
    "bias_correction": "bias correction is always applied, as in torch.optim.Adam",
    "max_grad_norm": "use the top-level 'gradient_clipping' key",
}
_OPTIMIZER_PARAMS_INERT = {
    "torch_adam": "the optimizer is always offload's fused Adam (CPUAdam on the host, torch's on the device)",
    "fp32_optimizer_states": "optimizer states are always fp32",
    "foreach": "a torch implementation switch; the optimizer is offload's own",
    "fused": "a torch implementation switch; the optimizer is offload's own",
}


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Section):
    """`optimizer`: {"type": "Adam" | "AdamW", "params": {lr, betas, eps, weight_decay, adam_w_mode}}.

    DeepSpeed semantics for weight decay: type "AdamW" always decays decoupled
    (AdamW); type "Adam" does too unless `adam_w_mode` is false, because
    DeepSpeed's `adam_w_mode` defaults to true. So {"type": "Adam"} with a
    weight decay is AdamW, as in DeepSpeed. `decoupled_weight_decay` and
    `effective_type` give the result; the engine uses them, not `type`.
    """

    SECTION: ClassVar[str] = "optimizer"
    PARAMS: ClassVar[tuple] = ("lr", "betas", "eps", "weight_decay", "adam_w_mode")
    type: OptimizerType
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True

    def __post_init__(self):
        k = lambda name: _join("optimizer.params", name)  # noqa: E731
        self._set("type", _enum("optimizer.type", self.type, OptimizerType, casefold=True))
        self._set("lr", _float(k("lr"), self.lr, lo=0.0, hf_auto=True))
        betas = self.betas
        if isinstance(betas, str) and betas == "auto":
            raise ConfigError(f"{k('betas')}: {_HF_AUTO}")
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise _fail(k("betas"), betas, "a list of two numbers in [0, 1)")
        self._set("betas", tuple(_float(f"{k('betas')}[{i}]", b, lo=0.0, hi=1.0, hi_open=True)
                                 for i, b in enumerate(betas)))
        self._set("eps", _float(k("eps"), self.eps, lo=0.0, lo_open=True, hf_auto=True))
        self._set("weight_decay", _float(k("weight_decay"), self.weight_decay, lo=0.0, hf_auto=True))
        _bool(k("adam_w_mode"), self.adam_w_mode)
        if self.type is OptimizerType.ADAMW and not self.adam_w_mode:
            raise ConfigError(
                "optimizer.params.adam_w_mode: false contradicts type 'AdamW' (DeepSpeed would silently "
                "use AdamW); for L2 weight decay use type 'Adam' with adam_w_mode false")

    @property
    def decoupled_weight_decay(self) -> bool:
        return self.type is OptimizerType.ADAMW or self.adam_w_mode

    @property
    def effective_type(self) -> OptimizerType:
        return OptimizerType.ADAMW if self.decoupled_weight_decay else OptimizerType.ADAM

    @classmethod
    def from_dict(cls, d: Mapping | None):
        if d is None:
            return None
        _check_keys("optimizer", d, ["type", "params"])
        if "type" not in d:
            raise ConfigError("optimizer.type: missing (accepted: Adam, AdamW)")
        kind = d["type"]
        if not (isinstance(kind, str) and kind.lower() in ("adam", "adamw")):
            raise ConfigError(f"optimizer.type: {kind!r} is not one of Adam, AdamW (offload's engine "
                              "runs Adam/AdamW only)")
        params = d.get("params") or {}
        _check_keys("optimizer.params", params, list(cls.PARAMS), _OPTIMIZER_PARAMS_REFUSED,
                    _OPTIMIZER_PARAMS_INERT)
        return cls(type=kind, **{k: v for k, v in params.items() if k not in _OPTIMIZER_PARAMS_INERT})

    @classmethod
    def inert_keys(cls, d: Mapping | None) -> list[tuple[str, str]]:
        params = d.get("params") if isinstance(d, Mapping) else None
        if not isinstance(params, Mapping):
            return []
        return [(f"optimizer.params.{k}", _OPTIMIZER_PARAMS_INERT[k]) for k in params
                if k in _OPTIMIZER_PARAMS_INERT]

    def to_dict(self) -> dict:
        return {"type": self.type.value,
                "params": {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                           "weight_decay": self.weight_decay, "adam_w_mode": self.adam_w_mode}}


# --------------------------------------------------------------------------- zero

_STAGE12 = "a ZeRO stage 1/2 option; offload runs ZeRO stage 3 only (DeepSpeed ignores it at stage 3 too)"
_NO_ZERO_PP = "ZeRO++ is not implemented: parameters and gradients move at full precision, unquantized"
_PER_MODULE = "parameters are fetched per module, in the order the last step used them"
_ZERO_INERT = {
    "cpu_offload_use_pin_memory": PIN_MEMORY_INERT,
    "round_robin_gradients": _STAGE12,
    "allgather_partitions": _STAGE12,
    "allgather_bucket_size": _STAGE12,
    "use_multi_rank_bucket_allreduce": _STAGE12,
    "ignore_unused_parameters": _STAGE12,
    "elastic_checkpoint": _STAGE12,
    "legacy_stage1": _STAGE12,
    "compute_grad_norm": _STAGE12,
    "reduce_scatter": "gradients are always reduce-scattered",
    "load_from_fp32_weights": "checkpoints always restore the fp32 master weights (bit-exact resume)",
    "stage3_model_persistence_threshold": "persistence is per parameter ('stage3_param_persistence_threshold')",
    "stage3_module_granularity_threshold": _PER_MODULE,
    "leaf_module": _PER_MODULE,
    "stage3_use_all_reduce_for_fetch_params": "parameters are all-gathered",
    "stage3_allgather_sequential": "parameters are all-gathered per module",
    "zero_quantized_weights": _NO_ZERO_PP,
    "zero_quantized_nontrainable_weights": _NO_ZERO_PP,
    "zero_quantized_gradients": _NO_ZERO_PP,
    "memory_efficient_linear": "offload does not replace torch functions (no monkeypatching)",
    "override_module_apply": "offload does not patch nn.Module.apply",
    "log_trace_cache_warnings": "there is no trace cache to warn about: a changed module order "
                                "costs prefetch speed, never an error",
    "enable_sanity_checks": "offload's state checks are always on",
    "pipeline_loading_checkpoint": "checkpoints are loaded shard by shard",
    "zenflow": "ZenFlow is not implemented: every update is applied at its step",
    "offload_states": "states stay in their configured tiers between steps",
    "save_muon_momentum_buffer_in_memory": "the optimizer is Adam/AdamW (no Muon buffers)",
}
# DeepSpeed's deprecated booleans for a whole section: true means {"device": "cpu"}.
_ZERO_DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
# Old DeepSpeed spellings of a key we read (Note [DeepSpeed keys]).
_ZERO_RENAMED = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(_Section):
    """`zero_optimization`: ZeRO stage 3, with parameter and optimizer offload.

    Sizes are in elements, as in DeepSpeed. `AUTO` ones are resolved by
    `Config.resolve_auto` (see docs/CONFIG.md).
    """

    SECTION: ClassVar[str] = "zero_optimization"
    INERT: ClassVar[dict] = _ZERO_INERT
    RENAMED: ClassVar[dict] = _ZERO_RENAMED
    CHILDREN: ClassVar[dict] = {"offload_param": OffloadParamConfig,
                                "offload_optimizer": OffloadOptimizerConfig}
    stage: int = 3
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    # None: sized from the model (offload.partition.prefetch.prefetch_scheduler).
    stage3_prefetch_bucket_size: Any = None
    stage3_max_live_parameters: Any = None
    stage3_max_reuse_distance: Any = None
    stage3_param_persistence_threshold: Any = 100_000
    sub_group_size: Any = 1_000_000_000
    # Gradient elements per reduce-scatter with several ranks (None: the largest
    # parameter) and gradients awaiting an overlapped update (None: two of the largest shards).
    reduce_bucket_size: Any = None
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    stage3_gather_16bit_weights_on_model_save: bool = False
    # The ranks a parameter is partitioned over (Note [hybrid sharding] in
    # offload/transfers/layout.py): "node", "world" or a number of ranks;
    # DeepSpeed's hpZ and MiCS sizes name it too (group_size).
    shard_group_size: Any = "node"
    zero_hpz_partition_size: Any = 1
    mics_shard_size: Any = -1
    mics_hierarchical_params_gather: bool = False

    PREFETCH: ClassVar[tuple] = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                                 "stage3_max_reuse_distance", "reduce_bucket_size")  # may be None
    SIZES: ClassVar[tuple] = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                              "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
                              "sub_group_size", "reduce_bucket_size")

    def __post_init__(self):
        k = self._key
        stage = self.stage
        if isinstance(stage, float) and stage.is_integer():
            stage = int(stage)
        if isinstance(stage, bool) or stage != 3:
            raise ConfigError(f"zero_optimization.stage: {stage!r} is not 3 (offload implements ZeRO stage 3 "
                              "only: parameters, gradients and optimizer states partitioned and offloadable)")
        self._set("stage", 3)
        for name, cls in (("offload_param", OffloadParamConfig), ("offload_optimizer", OffloadOptimizerConfig)):
            v = getattr(self, name)
            if v is None or isinstance(v, Mapping):
                self._set(name, cls.from_dict(v))
            elif not isinstance(v, cls):
                raise _fail(k(name), v, f"a JSON object or {cls.__name__}")
        for name in self.SIZES:
            lo = 1 if name in ("sub_group_size", "reduce_bucket_size") else 0
            self._set(name, _int(k(name), getattr(self, name), lo=lo, auto=True, none=name in self.PREFETCH))
        _bool(k("overlap_comm"), self.overlap_comm)
        _bool(k("stage3_gather_16bit_weights_on_model_save"), self.stage3_gather_16bit_weights_on_model_save)
        _bool(k("contiguous_gradients"), self.contiguous_gradients)  # false: see `value_notes`
        self._check_group_size()

    def _check_group_size(self) -> None:
        k = self._key
        size = self.shard_group_size
        if isinstance(size, float) and size.is_integer():
            size = int(size)
        if not (size in ("node", "world") or (isinstance(size, int) and not isinstance(size, bool) and size >= 1)):
            raise _fail(k("shard_group_size"), self.shard_group_size,
                        '"node" (the ranks of one node, the default), "world" (every rank) or a number of ranks')
        self._set("shard_group_size", size)
        self._set("zero_hpz_partition_size", _int(k("zero_hpz_partition_size"), self.zero_hpz_partition_size, lo=1))
        self._set("mics_shard_size", _int(k("mics_shard_size"), self.mics_shard_size, lo=-1))
        if self.mics_shard_size == 0:
            raise _fail(k("mics_shard_size"), 0, "a number of ranks, or -1 (off)")
        _bool(k("mics_hierarchical_params_gather"), self.mics_hierarchical_params_gather)
        named = {key: v for key, v in (("zero_hpz_partition_size", self.zero_hpz_partition_size),
                                        ("mics_shard_size", self.mics_shard_size)) if v > 1}
        if size != "node":
            named["shard_group_size"] = size
        if len(set(named.values())) > 1:
            raise ConfigError("zero_optimization: " + ", ".join(f"{key} {v!r}" for key, v in named.items())
                              + " name different shard groups; give one (shard_group_size is offload's own)")

    @property
    def group_size(self):
        """The shard group: "node", "world" or a number of ranks (Note [hybrid sharding])."""
        if self.shard_group_size != "node":
            return self.shard_group_size
        return next((v for v in (self.zero_hpz_partition_size, self.mics_shard_size) if v > 1), "node")

    @classmethod
    def _fields_of(cls, d: Mapping) -> dict:
        """Maps DeepSpeed's deprecated `cpu_offload` / `cpu_offload_param` to their sections."""
        d = dict(d) if isinstance(d, Mapping) else d
        for old, section in _ZERO_DEPRECATED_OFFLOAD.items():
            if not isinstance(d, dict) or old not in d:
                continue
            if not _bool(_join(cls.SECTION, old), d.pop(old)):
                continue
            given = d.get(section)
            device = given.get("device", "none") if isinstance(given, Mapping) else given
            if given is not None and device != "cpu":
                raise ConfigError(f"'{_join(cls.SECTION, old)}': true (DeepSpeed's old name for "
                                  f"{section}.device 'cpu') contradicts '{_join(cls.SECTION, section)}' "
                                  f"({_show(given)}); keep only '{section}'")
            d.setdefault(section, {"device": "cpu"})
        return super()._fields_of(d)

    def value_notes(self) -> list[tuple[str, str]]:
        """(key, why) for values that have no effect here (Note [DeepSpeed keys])."""
        notes = [*self.offload_param.unused, *self.offload_optimizer.unused]
        if self.zero_hpz_partition_size > 1:
            notes.append(("zero_optimization.zero_hpz_partition_size",
                          f"{self.zero_hpz_partition_size}: parameters are gathered within groups of that many "
                          "ranks, as hpZ's secondary copy is, but the fp32 master and the optimizer state are "
                          "partitioned within the group and copied across groups (as MiCS does), not partitioned "
                          "over every rank: each rank holds 1/group of them, where hpZ holds 1/world; `offload "
                          "estimate --group-size` states the bytes (Note [hybrid sharding])"))
        if self.mics_hierarchical_params_gather:
            notes.append(("zero_optimization.mics_hierarchical_params_gather",
                          "has no effect: a shard group within one node gathers over that node's links only; "
                          "a group spanning nodes gathers flat over its ranks"))
        if not self.contiguous_gradients:
            notes.append(("zero_optimization.contiguous_gradients",
                          "false has no effect: gradients are always written into contiguous per-shard buffers"))
        return notes

    def resolve_auto(self, hidden_size: int | None, num_params: int) -> "ZeroConfig":
        """A copy with AUTO sizes replaced (rules in `Config.resolve_auto`)."""
        hidden_size = _int("resolve_auto: hidden_size", hidden_size, lo=1, none=True)
        num_params = _int("resolve_auto: num_params", num_params, lo=1)
        if hidden_size is None:
            from_model = {"reduce_bucket_size": None, "stage3_prefetch_bucket_size": None,
                          "stage3_param_persistence_threshold": 100_000}
        else:
            from_model = {"reduce_bucket_size": hidden_size * hidden_size,
                          "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                          "stage3_param_persistence_threshold": 10 * hidden_size}
        # 'auto' live/reuse limits: sized from the model at initialize, as when unset.
        from_model.update(stage3_max_live_parameters=None, stage3_max_reuse_distance=None,
                          sub_group_size=min(1_000_000_000, num_params))
        return dataclasses.replace(self, **{n: from_model[n] for n in self.SIZES if getattr(self, n) is AUTO})


# --------------------------------------------------------------------------- aio

class AioSection:
    """Reads the `aio` section into offload.aio.AioConfig, the one I/O config type
    (the I/O layer may not import this package, so DeepSpeed's key handling is here).

    `thread_count`, which DeepSpeed's docs give and its code reads as
    `intra_op_parallelism`, is mapped to it. single_submit and overlap_events
    are accepted for DeepSpeed configs and checked: offload always submits in
    batches and overlaps completion, so the other value is named as having no
    effect (Note [DeepSpeed keys] in base.py). Every other key is a field of
    AioConfig and reaches each AsyncIO as given.
    """

    SECTION: ClassVar[str] = "aio"
    TYPE: ClassVar[type] = AioConfig
    RENAMED: ClassVar[dict] = {"thread_count": "intra_op_parallelism"}
    INERT: ClassVar[dict] = {
        "use_gds": "GPUDirect Storage is not supported: NVMe reads and writes go through host memory",
    }
    # key -> (the value offload acts as, why another value has no effect)
    FIXED: ClassVar[dict] = {
        "single_submit": (False, "true has no effect: requests are always submitted in batches"),
        "overlap_events": (True, "false has no effect: submission and completion always overlap"),
    }

    @classmethod
    def from_dict(cls, d: Mapping | None) -> AioConfig:
        if d is None:
            return AioConfig()
        accepted = [f.name for f in dataclasses.fields(AioConfig)] + list(cls.FIXED)
        _check_keys(cls.SECTION, d, accepted, inert=cls.INERT, renamed=cls.RENAMED)
        d = _apply_renames(cls.SECTION, d, cls.RENAMED)
        for key in cls.FIXED:
            if key in d:
                _bool(_join(cls.SECTION, key), d[key])
        try:
            return AioConfig(**{k: v for k, v in d.items() if k not in cls.INERT and k not in cls.FIXED})
        except ValueError as exc:  # AioConfig's own checks name the key
            raise ConfigError(str(exc)) from None

    @classmethod
    def inert_keys(cls, d: Mapping | None) -> list[tuple[str, str]]:
        """(dotted key, why) for inert keys and FIXED keys given another value, in the raw `d`."""
        if not isinstance(d, Mapping):
            return []
        found = [(_join(cls.SECTION, k), cls.INERT[k]) for k in d if k in cls.INERT]
        return found + [(_join(cls.SECTION, k), why) for k, (acted_on, why) in cls.FIXED.items()
                        if k in d and d[k] != acted_on]


# --------------------------------------------------------------------------- memory (ours)

@dataclass(frozen=True, kw_only=True)
class MemoryConfig(_Section):
    """`memory` (offload's own): byte budgets per tier; ints or strings like "8GiB".

    device_budget: bytes the device tier may hold (on a CPU-only host, the budget of the
      plain memory that stands in for the device); None = the GPU's memory, or unlimited.
    host_budget: bytes of host memory the engine may hold, pinned included; None = no limit.
    pinned_budget: bytes of page-locked host memory the parameter side may pin (a part of
      host_budget; Note [pin_memory]); None = no bound of its own.
    """

    SECTION: ClassVar[str] = "memory"
    device_budget: int | None = None
    host_budget: int | None = None
    pinned_budget: int | None = None

    def __post_init__(self):
        for name in ("device_budget", "host_budget", "pinned_budget"):
            v = getattr(self, name)
            if v is not None:
                self._set(name, parse_bytes(v, self._key(name)))
        if None not in (self.pinned_budget, self.host_budget) and self.pinned_budget > self.host_budget:
            raise ConfigError(f"memory.pinned_budget: {self.pinned_budget} bytes is more than memory.host_budget "
                              f"({self.host_budget}), which includes pinned memory; lower it to at most "
                              f"{self.host_budget}")
