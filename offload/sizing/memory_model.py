"""`offload estimate`'s memory model: bytes per tier, and the minimum device, host and NVMe,
for a model size and a configuration, before anything is allocated.

    est = estimate(7e9, config="ds.json", world_size=8)
    est = estimate(model_config="config.json", config={...}, trainable="adapter_config.json")
    print(est.format())

Note [memory model] (per parameter; W = world size, the states are sharded 1/W):
  trainable parameters (all of them unless `trainable` says otherwise):
  compute copy     c B (2 for bf16/fp16, 4 for fp32)    -> offload_param tier
  grad accumulation 4 B (fp32)                           -> device if offload_optimizer
                                                            is none, else host
  fp32 master      4 B, only when c != 4 (in fp32 the    -> offload_optimizer tier
                   parameter copy is the master)
  exp_avg, exp_avg_sq 4 B + 4 B                          -> offload_optimizer tier
  frozen parameters (requires_grad=False: a LoRA's base; Note [frozen
  parameters] in offload/placement.py):
  compute copy     c B                                   -> offload_param tier
                   and nothing else: no gradient, master, moments or NVMe state
  with `frozen_quant` (--frozen-quant nf4|fp4|int8: a QLoRA base), each frozen
  Linear weight but lm_head (which transformers keeps unquantized) instead
  quantized bytes  1/2 B (4-bit) or 1 B (int8)           -> offload_param tier
  its state        4-bit: ~1/64 B (double quantization); -> beside compute
                   int8: 4 B a row (quantized_home in partition/quantized.py)
  Device, always: the largest layer gathered (c B per param, unsharded) twice
  (the one computing and the one prefetched), plus the persistent parameters
  (those under stage3_param_persistence_threshold, kept whole on every rank).
  Host bounce buffers: with offload_param nvme, 2 x largest layer x c; with
  offload_optimizer nvme, min(sub_group_size, trainable shard) x 16 B (master,
  m, v, grad) x 2 (double buffering).
Tiers are reported per rank; the minimum host and NVMe are per node (ranks per
node x per rank), the minimum device per device. docs/CONFIG.md compares this
with DeepSpeed's estimate_zero3_model_states_mem_needs term by term.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Mapping

from offload.config import AUTO, Config, ConfigError, Precision, Tier
from offload.engine.budgets import default_host_budget
from offload.engine.reserve import Reserve, reserve, settle_plan
from offload.placement import (DEVICE_SHARE, HOST_SHARE, Budgets, ParamSpec, Placement, nvme_state_buffers,
                               plan_placement, uniform)
from offload.partition.quantized import QUANT_METHODS, quantized_home
from offload.sizing.hf_config import CountedModel
from offload.sizing.model_shapes import counted_model
from offload.sizing.trainable import parse_trainable

GiB = 1 << 30
TIERS = ("device", "host", "nvme")
# Without a model config or an explicit largest layer: a transformer's largest
# module (its embedding or an MLP projection) is rarely above 1/16 of it for
# models of 1B parameters and more; smaller models can exceed it (GPT-2 124M's
# embedding is 31%), so give --largest-layer or --model-config for those.
LARGEST_LAYER_FRACTION = 16


@dataclass(frozen=True)
class Estimate:
    """Bytes per tier per rank, what contributes what, and the minimum per device / node."""

    num_params: int
    trainable_params: int  # of num_params; the rest are frozen (Note [trainable share])
    largest_layer_params: int
    persistent_params: int
    world_size: int
    num_nodes: int
    precision: Precision
    group_size: int  # the ranks a parameter is partitioned over (Note [hybrid sharding])
    param_bytes: int  # every parameter as gathered, padded: its itemsize or its quantized bytes
    offload_param: Tier
    offload_optimizer: Tier
    device: int
    host: int
    nvme: int
    breakdown: dict[str, dict[str, int]]
    minimum_device: int
    minimum_host: int
    minimum_nvme: int
    notes: tuple[str, ...] = ()
    placement: Placement | None = None  # "auto": the plan (Note [automatic placement])
    auto_param: bool = False  # offload_param.device "auto"
    auto_optimizer: bool = False
    # What initialize checks against memory.device_budget and host_budget, per tier, {what:
    # bytes}: its own function on the parameters counted here (engine/reserve.py). Under
    # "auto" the breakdown's device and host are these.
    needs: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def frozen_params(self) -> int:
        return self.num_params - self.trainable_params

    def _side(self, which: str) -> str:
        """DeepSpeed's spelling of offload_<which>.device: none, cpu, nvme or auto."""
        if getattr(self, f"auto_{which}"):
            return "auto"
        return getattr(self, f"offload_{which}").offload_device

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    def check_budgets(self, memory) -> list[str]:
        """What does not fit in `memory` (a MemoryConfig) per rank: one line each; [] when all fit."""
        problems = []
        for tier, budget in (("device", memory.device_budget), ("host", memory.host_budget)):
            need = getattr(self, tier)
            if budget is not None and need > budget:
                problems.append(f"memory.{tier}_budget: {_gib(budget)} is less than the {_gib(need)} "
                                f"the {tier} tier needs per rank")
        return problems

    def to_dict(self) -> dict:
        d = dataclasses.asdict(dataclasses.replace(self, placement=None))
        d["placement"] = None if self.placement is None else self.placement.to_dict()
        d.update(precision=self.precision.value, offload_param=self._side("param"),
                 offload_optimizer=self._side("optimizer"), notes=list(self.notes),
                 frozen_params=self.frozen_params)
        return d

    def format(self) -> str:
        lines = [
            f"offload estimate: {_count(self.num_params)} params ({_count(self.trainable_params)} trainable, "
            f"{_count(self.frozen_params)} frozen), largest layer "
            f"{_count(self.largest_layer_params)}, persistent {_count(self.persistent_params)}; "
            f"{self.precision.value}, offload_param={self._side('param')}, "
            f"offload_optimizer={self._side('optimizer')}; "
            f"{self.world_size} rank(s) on {self.num_nodes} node(s)"
            + (f", shard groups of {self.group_size} (a copy of the partitioned state in each)"
               if self.group_size < self.world_size else ""),
            "",
            f"{'tier':<8}{'per rank':>12}   contributions",
        ]
        for tier in TIERS:
            lines.append(f"{tier:<8}{_gib(getattr(self, tier)):>12}")
            for what, nbytes in self.breakdown[tier].items():
                lines.append(f"{'':<8}{'':>12}   {_gib(nbytes):>11}  {what}")
        lines += ["",
                  f"minimum: device {_gib(self.minimum_device)} per device, host {_gib(self.minimum_host)} "
                  f"per node, nvme {_gib(self.minimum_nvme)} per node",
                  "(model states only: activations, the CUDA context and allocator slack come on top)"]
        for tier, parts in self.needs.items() if self.placement is None else ():  # auto: the breakdown
            if parts:
                lines += ["", f"initialize checks against memory.{tier}_budget: {_gib(sum(parts.values()))} "
                          "per rank (its own terms)"]
                lines += [f"{'':<8}{'':>12}   {_gib(n):>11}  {what}" for what, n in parts.items()]
        if self.placement is not None:
            lines += ["", self.placement.format()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _count(n: int) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


# What `offload estimate` calls each argument of estimate(): its messages and
# notes name the flag the user typed, not the Python keyword.
CLI_FLAGS = {"num_params": "--params", "model_config": "--model-config",
             "largest_layer_params": "--largest-layer", "persistent_params": "--persistent-params",
             "world_size": "--world-size", "num_nodes": "--num-nodes", "trainable": "--trainable",
             "frozen_quant": "--frozen-quant", "group_size": "--group-size"}


def estimate(num_params: int | None = None, *, model_config: str | os.PathLike | Mapping | None = None,
             config: Config | Mapping | str | os.PathLike | None = None,
             largest_layer_params: int | None = None, persistent_params: int | None = None,
             world_size: int = 1, num_nodes: int = 1,
             trainable: int | float | str | os.PathLike | Mapping | None = None,
             frozen_quant: str | None = None, group_size: int | str | None = None) -> Estimate:
    """Bytes per tier for `num_params` (or a HF model config) under `config`; see Note [memory model].

    world_size is the total number of ranks, num_nodes how many hosts they share.
    group_size: the ranks each parameter is partitioned over ("node", "world" or a number;
    None: the config's zero_optimization.shard_group_size; Note [hybrid sharding]).
    trainable: how much of the model trains (Note [trainable share]): a count
    (8_000_000, "8M"), a fraction (0.011, "1.1%"), or a PEFT LoRA adapter config
    (a path to adapter_config.json or its folder, or the dict; needs model_config);
    None: all of it.
    frozen_quant: the frozen Linear weights quantized by bitsandbytes ("nf4" or "fp4" with
    double quantization, "int8"), as a QLoRA base is loaded; needs model_config.
    Without config: Config() (fp32, nothing offloaded).
    """
    return estimate_from(num_params, model_config=model_config, config=config,
                     largest_layer_params=largest_layer_params, persistent_params=persistent_params,
                     world_size=world_size, num_nodes=num_nodes, trainable=trainable, names={},
                     frozen_quant=frozen_quant, group_size=group_size)


def estimate_from(num_params, *, model_config, config, largest_layer_params, persistent_params, world_size,
              num_nodes, trainable, names: Mapping[str, str], frozen_quant: str | None = None,
              group_size: int | str | None = None) -> Estimate:
    """estimate(), its errors and notes naming each argument as `names` spells it
    (the keyword itself where absent)."""
    def name(keyword: str) -> str:
        return names.get(keyword, keyword)

    cfg = Config() if config is None else Config.load(config)
    for key, v in (("world_size", world_size), ("num_nodes", num_nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name(key)}: {v!r} is not a positive integer")
    if world_size % num_nodes:
        raise ConfigError(f"{name('world_size')}: {world_size} is not a multiple of {name('num_nodes')} "
                          f"{num_nodes}")
    parts = _shard_group(cfg, group_size, world_size, num_nodes, name)
    share = None if trainable is None else parse_trainable(trainable, name("trainable"))
    if frozen_quant is not None and (frozen_quant not in QUANT_METHODS or model_config is None):
        raise ConfigError(f"{name('frozen_quant')}: {frozen_quant!r} needs one of {', '.join(QUANT_METHODS)} and "
                          f"{name('model_config')} (which of the frozen weights are Linear weights)")
    adapter = None if share is None else share.adapter
    notes = []
    zero = cfg.zero_optimization
    threshold = zero.stage3_param_persistence_threshold
    model = None
    if model_config is not None:
        if num_params is not None:
            raise ConfigError(f"estimate: give {name('num_params')} or {name('model_config')}, not both")
        model = counted_model(model_config, adapter, name("trainable"))
        sizes = model.sizes(None if threshold is AUTO else threshold)
        num_params, hidden, trainable_params = sizes.num_params, sizes.hidden_size, sizes.trainable_params
        notes += model.notes
        if largest_layer_params is None:
            largest_layer_params = sizes.largest_layer_params
            notes.append(f"largest layer and persistent parameters counted from the {sizes.source}"
                         + (" with the adapters" if adapter is not None else ""))
        if persistent_params is None:
            persistent_params = sizes.persistent_params
    else:
        if num_params is None:
            raise ConfigError(f"estimate: give {name('num_params')} or {name('model_config')}")
        if adapter is not None:
            raise ConfigError(f"{name('trainable')}: a PEFT adapter config needs {name('model_config')} (the "
                              f"shapes of the modules it adapts); with {name('num_params')}, give "
                              f"{name('trainable')} a count (8M) or a fraction (0.011, 1.1%)")
        hidden = None
        if isinstance(num_params, float) and num_params.is_integer():
            num_params = int(num_params)
        if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
            raise ConfigError(f"{name('num_params')}: {num_params!r} is not a positive integer")
        trainable_params = num_params
        if largest_layer_params is None:
            largest_layer_params = math.ceil(num_params / LARGEST_LAYER_FRACTION)
            notes.append(f"largest layer not given: assumed {name('num_params')} / {LARGEST_LAYER_FRACTION} "
                         f"(give {name('largest_layer_params')} or {name('model_config')} for an exact figure)")
        if persistent_params is None:
            persistent_params = 0
            notes.append(f"persistent parameters not given: assumed 0 (give {name('persistent_params')}, "
                         f"or {name('model_config')} to count them)")
    if share is not None and adapter is None:
        trainable_params = share.of(num_params, name("trainable"))
    for key, v in (("largest_layer_params", largest_layer_params), ("persistent_params", persistent_params)):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > num_params:
            raise ConfigError(f"{name(key)}: {v!r} is not an integer in [0, {num_params}] "
                              "(from 0 to the model's parameter count)")
    largest_layer_params, persistent_params = int(largest_layer_params), int(persistent_params)
    # What one module's update holds at once: the largest layer, or less of it where
    # some is frozen (a LoRA's largest trainable module is an adapter or a saved copy).
    largest_trainable = min(largest_layer_params, trainable_params)
    if adapter is not None:
        largest_trainable = min(largest_trainable, model.largest_trainable)
    zero = zero.resolve_auto(hidden, num_params)

    c = cfg.precision.itemsize
    shard = math.ceil(num_params / parts)
    trainable_shard = math.ceil(trainable_params / parts)
    frozen = trainable_params < num_params
    # Optimizer terms are per trainable element: said so where some are frozen.
    per = "B/trainable param" if frozen else "B/param"
    p_dev, o_dev = zero.offload_param.device, zero.offload_optimizer.device
    p_tier, o_tier, grad_tier = p_dev.value, o_dev.value, zero.offload_optimizer.grad_tier.value
    prec = cfg.precision.value
    breakdown: dict[str, dict[str, int]] = {t: {} for t in TIERS}
    specs = _specs(zero, num_params, trainable_params, largest_layer_params, persistent_params, parts, model,
                   tail_share=share is not None and adapter is None, notes=notes, name=name,
                   frozen_quant=frozen_quant)
    quantized = [s for s in specs if s.itemsize is not None]
    if frozen:  # the frozen ones' home is all they cost (Note [frozen parameters] in offload/placement.py)
        dense = sum(s.part_numel for s in specs if not s.trainable and s.itemsize is None)
        breakdown[p_tier][f"parameter shards, trainable ({prec}, {c} B/param)"] = trainable_shard * c
        breakdown[p_tier][f"parameter shards, frozen ({prec}, {c} B/param, nothing else)"] = \
            (dense if quantized else shard - trainable_shard) * c
        if quantized:
            breakdown[p_tier][f"parameter shards, frozen, quantized ({frozen_quant})"] = \
                sum(s.part_numel * s.itemsize for s in quantized)
            breakdown["device"]["quantization state (whole beside compute)"] = sum(s.side_bytes for s in quantized)
    else:
        breakdown[p_tier][f"parameter shards ({prec}, {c} B/param)"] = shard * c
    breakdown[grad_tier][f"gradient accumulation (fp32, 4 {per})"] = trainable_shard * 4
    if c != 4:
        breakdown[o_tier][f"fp32 master weights (4 {per})"] = trainable_shard * 4
    breakdown[o_tier][f"Adam exp_avg + exp_avg_sq (fp32, 8 {per})"] = trainable_shard * 8
    breakdown["device"][f"gathered layers (2 x largest layer, {prec})"] = 2 * largest_layer_params * c
    breakdown["device"][f"persistent parameters ({prec}, whole on every rank)"] = persistent_params * c
    if p_dev is Tier.NVME:
        breakdown["host"][f"parameter NVMe bounce buffers (2 x largest layer, {prec})"] = \
            2 * largest_layer_params * c
    if o_dev is Tier.NVME:  # what the update keeps in flight, as initialize reserves it (engine/budgets.py)
        for what, nbytes in nvme_state_buffers(-(-largest_trainable // parts), c, p_dev is Tier.NVME).items():
            breakdown["host"][what] = nbytes
    placement = None
    auto = zero.offload_param.auto or zero.offload_optimizer.auto
    # zero: its "auto" sizes resolved, as initialize resolves them from the model
    plan, held = _plan_and_reserve(dataclasses.replace(cfg, zero_optimization=zero), specs, parts, world_size // num_nodes, auto=auto, notes=notes)
    needs = {t.value: dict(parts) for t, parts in held.need.items()}
    if auto:
        # The plan's device and host are what initialize checks against their budgets,
        # term by term (engine/budgets.py tier_needs); NVMe holds the planned homes and state.
        placement = plan
        breakdown = {**needs, "nvme": {}}
        homes = placement.home_bytes()[Tier.NVME]
        frozen_homes = dataclasses.replace(placement, shards=tuple(s for s in placement.shards
                                                                   if not s.trainable)).home_bytes()[Tier.NVME]
        if frozen and homes - frozen_homes:
            breakdown["nvme"][f"parameter shards, planned, trainable ({prec}, {c} B/param)"] = homes - frozen_homes
        if frozen and frozen_homes:
            kind = f"{prec}, {c} B/param" + (f", or {frozen_quant}-quantized" if quantized else "")
            breakdown["nvme"][f"parameter shards, planned, frozen ({kind}, nothing else)"] = frozen_homes
        if not frozen and homes:
            breakdown["nvme"][f"parameter shards, planned ({prec}, {c} B/param)"] = homes
        if placement.state_bytes()[Tier.NVME]:
            breakdown["nvme"]["optimizer state, planned (fp32 master + exp_avg + exp_avg_sq)"] = \
                placement.state_bytes()[Tier.NVME]
    totals = {t: sum(breakdown[t].values()) for t in TIERS}
    per_node = world_size // num_nodes
    return Estimate(
        num_params=num_params, trainable_params=trainable_params, largest_layer_params=largest_layer_params,
        persistent_params=persistent_params, world_size=world_size, num_nodes=num_nodes, precision=cfg.precision,
        group_size=parts, param_bytes=sum(s.padded_numel * (s.itemsize or c) for s in specs),
        offload_param=p_dev, offload_optimizer=o_dev, breakdown=breakdown, **totals,
        minimum_device=totals["device"], minimum_host=totals["host"] * per_node,
        minimum_nvme=totals["nvme"] * per_node, notes=tuple(notes), placement=placement,
        auto_param=zero.offload_param.auto, auto_optimizer=zero.offload_optimizer.auto, needs=needs)


def _shard_group(cfg: Config, setting, world_size: int, num_nodes: int, name) -> int:
    """The shard group's size for `world_size` ranks numbered node by node (Note [hybrid sharding])."""
    from offload.transfers.layout import group_size

    if setting is None:
        setting = cfg.zero_optimization.group_size
    elif setting not in ("node", "world"):
        given = setting
        try:
            setting = int(setting)
        except (TypeError, ValueError):
            setting = 0
        if setting < 1 or isinstance(given, bool):
            raise ConfigError(f"{name('group_size')}: {given!r} is not 'node', 'world' or a number of ranks")
    per_node = world_size // num_nodes
    try:
        return group_size(setting, [f"node{r // per_node}" for r in range(world_size)])[0]
    except ValueError as exc:
        raise ConfigError(f"{name('group_size')}: {exc}") from exc


def _specs(zero, num_params, trainable_params, largest, persistent, world_size, model: CountedModel | None, *,
           tail_share: bool, notes: list, name, frozen_quant: str | None = None) -> list[ParamSpec]:
    """The parameters as initialize would partition them: per parameter from
    --model-config, else the model cut into layers of the largest size (one parameter
    each). tail_share: trainable_params is a count without the parameters it names,
    taken from the model's tail (Note [trainable share]). frozen_quant: each frozen Linear
    weight but lm_head's at its quantized size (quantized_home)."""
    threshold = zero.stage3_param_persistence_threshold
    # (name, elements, persistent, trainable) in the model's order
    if model is not None:
        params = [(f"{m.name}.{i}", n, n <= threshold, m.trainable(i))
                  for m in model.distinct() for i, n in enumerate(m.sizes)]
    else:
        params, left, i = [], num_params - persistent, 0
        while left > 0:
            params.append((f"layer{i}", min(largest, left), False, True))
            left, i = left - params[-1][1], i + 1
        if persistent:
            params.append(("persistent", persistent, True, True))
    quant = {}  # name -> (home elements, side bytes) of a quantized weight
    if frozen_quant is not None:
        for m in model.distinct():
            if m.kind == "linear" and m.name != "lm_head" and not m.trainable(0):
                quant[f"{m.name}.0"] = quantized_home(m.features[1], m.features[0], frozen_quant)
        params = [(p, quant[p][0], quant[p][0] <= threshold, t) if p in quant else (p, n, pers, t)
                  for p, n, pers, t in params]
    if tail_share and trainable_params < num_params:
        split, left = [], trainable_params
        for pname, n, pers, _ in reversed(params):
            take = min(n, left)
            left -= take
            if take:
                split.append((pname + (".trainable" if take < n else ""), take, pers, True))
            if n - take:
                split.append((pname + (".frozen" if take else ""), n - take, pers, False))
        params = split[::-1]
        if zero.offload_param.auto or zero.offload_optimizer.auto:
            notes.append(f"auto placement: {name('trainable')} says how many parameters train, not which: "
                         "the plan takes them from the model's tail")
    return [ParamSpec(pname, -(-n // world_size), -(-n // world_size) * world_size, persistent=pers,
                      trainable=train, itemsize=1 if pname in quant else None,
                      side_bytes=quant[pname][1] if pname in quant else 0)
            for pname, n, pers, train in params]


def _plan_and_reserve(cfg: Config, specs: list[ParamSpec], world_size: int, local_ranks: int, *, auto: bool,
                      notes: list) -> tuple[Placement, Reserve]:
    """The plan initialize would make, and what it would reserve beside it, by
    initialize's own functions (engine/reserve.py; Note [automatic placement]). The
    device is taken to have memory of its own (a GPU): estimate opens none. An auto
    plan's budgets: the host's as initialize takes it (memory.host_budget, else
    HOST_SHARE of this machine's available memory over its ranks), the device's
    DEVICE_SHARE of memory.device_budget (none without one)."""
    zero, mem = cfg.zero_optimization, cfg.memory
    itemsize = cfg.precision.itemsize

    def reserve_of(placement: Placement) -> Reserve:
        # Each counted parameter is a module of its own: what one module gathers is one parameter.
        return reserve(list(placement.shards), cfg, separate_memory=True, world_size=world_size, on_demand=0)

    if not auto:
        placement = uniform(specs, home_tier=zero.offload_param.device, state=zero.offload_optimizer.device,
                            itemsize=itemsize, separate_memory=True)
        return placement, reserve_of(placement)
    if mem.host_budget is None:
        notes.append(f"auto placement: host budget {_gib(default_host_budget(cfg, local_ranks))} ({HOST_SHARE:.0%} "
                     "of this machine's available memory; give memory.host_budget for another machine)")
    if mem.device_budget is None:
        notes.append("auto placement: no memory.device_budget, so no parameter is planned on the device "
                     "beyond the persistent ones (initialize takes half the GPU's free memory)")
    first = Budgets(device=int(DEVICE_SHARE * (mem.device_budget or 0)), host=default_host_budget(cfg, local_ranks),
                    nvme_homes=zero.offload_param.auto and zero.offload_param.nvme_path is not None,
                    nvme_state=zero.offload_optimizer.auto and zero.offload_optimizer.nvme_path is not None)

    def plan_within(budgets: Budgets) -> Placement:
        return plan_placement(specs, budgets, itemsize=itemsize, separate_memory=True,
                              home_tier=None if zero.offload_param.auto else zero.offload_param.device,
                              state_tier=None if zero.offload_optimizer.auto else zero.offload_optimizer.device)

    placement, held = settle_plan(plan_within(first), cfg, plan_within, reserve_of)
    return dataclasses.replace(placement, host_limit=first.host), held