"""`offload estimate`: bytes per tier, and the minimum device, host and NVMe,
for a model size and a configuration, before anything is allocated.

    est = estimate(7e9, config="ds.json", world_size=8)
    est = estimate(model_config="config.json", config={...})
    print(est.format())

Note [memory model] (per parameter; W = world size, the states are sharded 1/W):
  compute copy     c B (2 for bf16/fp16, 4 for fp32)    -> offload_param tier
  grad accumulation 4 B (fp32)                           -> device if offload_optimizer
                                                            is none, else host
  fp32 master      4 B, only when c != 4 (in fp32 the    -> offload_optimizer tier
                   parameter copy is the master)
  exp_avg, exp_avg_sq 4 B + 4 B                          -> offload_optimizer tier
  Device, always: the largest layer gathered (c B per param, unsharded) twice
  (the one computing and the one prefetched), plus the persistent parameters
  (those under stage3_param_persistence_threshold, kept whole on every rank).
  Host bounce buffers: with offload_param nvme, 2 x largest layer x c; with
  offload_optimizer nvme, min(sub_group_size, shard) x 16 B (master, m, v,
  grad) x 2 (double buffering).
Tiers are reported per rank; the minimum host and NVMe are per node (ranks per
node x per rank), the minimum device per device. docs/CONFIG.md compares this
with DeepSpeed's estimate_zero3_model_states_mem_needs term by term.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from offload.config import AUTO, Config, ConfigError, Precision, Tier
from offload.placement import DEVICE_SHARE, HOST_SHARE, Budgets, ParamSpec, Placement, plan_placement
from offload.tiers import grad_tier_of

__all__ = ["Estimate", "ModelSizes", "add_arguments", "estimate", "model_sizes", "run"]

GiB = 1 << 30
TIERS = ("device", "host", "nvme")
# Without a model config or an explicit largest layer: a transformer's largest
# module (its embedding or an MLP projection) is rarely above 1/16 of it for
# models of 1B parameters and more; smaller models can exceed it (GPT-2 124M's
# embedding is 31%), so give --largest-layer or --model-config for those.
LARGEST_LAYER_FRACTION = 16


@dataclass(frozen=True)
class ModelSizes:
    """What the estimate needs from a model: parameter counts, in elements."""

    num_params: int             # distinct parameters (tied weights once)
    largest_layer_params: int   # the largest module's own parameters (DeepSpeed's definition)
    persistent_params: int      # parameters under the persistence threshold
    hidden_size: int | None
    source: str


def _module_params(cfg: Mapping) -> tuple[list[tuple[str, list[int]]], set[str], int]:
    """([(module name, [param numels])], modules whose params are tied to another, hidden)."""
    def need(*keys):
        for key in keys:
            if key in cfg:
                v = cfg[key]
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise ConfigError(f"model config: {key}: {v!r} is not a positive integer")
                return v
        raise ConfigError(f"model config: missing {' or '.join(repr(k) for k in keys)}")

    model_type = cfg.get("model_type")
    modules: list[tuple[str, list[int]]] = []
    tied: set[str] = set()
    if model_type == "gpt2" or ("n_embd" in cfg and "hidden_size" not in cfg):
        h, n, v = need("n_embd"), need("n_layer"), need("vocab_size")
        positions = need("n_positions")
        inner = cfg.get("n_inner") or 4 * h
        modules += [("wte", [v * h]), ("wpe", [positions * h])]
        for i in range(n):
            modules += [(f"h.{i}.ln_1", [h, h]), (f"h.{i}.attn.c_attn", [h * 3 * h, 3 * h]),
                        (f"h.{i}.attn.c_proj", [h * h, h]), (f"h.{i}.ln_2", [h, h]),
                        (f"h.{i}.mlp.c_fc", [h * inner, inner]), (f"h.{i}.mlp.c_proj", [inner * h, h])]
        modules += [("ln_f", [h, h]), ("lm_head", [v * h])]
        if cfg.get("tie_word_embeddings", True):
            tied.add("lm_head")
        return modules, tied, h
    # Llama family (llama, mistral, qwen2, ...): no biases except where the config says.
    h, n, v = need("hidden_size"), need("num_hidden_layers"), need("vocab_size")
    inter = need("intermediate_size")
    heads = need("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    qkv_bias = bool(cfg.get("attention_bias", False)) or model_type == "qwen2"
    o_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))

    def linear(i, o, bias):
        return [i * o] + ([o] if bias else [])

    modules.append(("embed_tokens", [v * h]))
    for i in range(n):
        p = f"layers.{i}"
        modules += [(f"{p}.self_attn.q_proj", linear(h, q, qkv_bias)),
                    (f"{p}.self_attn.k_proj", linear(h, kv, qkv_bias)),
                    (f"{p}.self_attn.v_proj", linear(h, kv, qkv_bias)),
                    (f"{p}.self_attn.o_proj", linear(q, h, o_bias)),
                    (f"{p}.mlp.gate_proj", linear(h, inter, mlp_bias)),
                    (f"{p}.mlp.up_proj", linear(h, inter, mlp_bias)),
                    (f"{p}.mlp.down_proj", linear(inter, h, mlp_bias)),
                    (f"{p}.input_layernorm", [h]), (f"{p}.post_attention_layernorm", [h])]
    modules += [("norm", [h]), ("lm_head", [v * h])]
    if cfg.get("tie_word_embeddings", False):
        tied.add("lm_head")
    return modules, tied, h


def _load_model_config(model_config: str | os.PathLike | Mapping) -> tuple[dict, str]:
    if isinstance(model_config, Mapping):
        return dict(model_config), "model config"
    path = Path(model_config)
    try:
        d = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"model config {str(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model config {str(path)!r}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"model config {str(path)!r}: the top level is not a JSON object")
    return d, f"model config {path.name}"


def model_sizes(model_config: str | os.PathLike | Mapping, persistence_threshold: int | None = None) -> ModelSizes:
    """Parameter counts of a GPT-2 or Llama-style HF `config.json` (a path or a dict).

    persistence_threshold None means the 'auto' value, 10 x hidden_size.
    """
    cfg, source = _load_model_config(model_config)
    modules, tied, hidden = _module_params(cfg)
    if persistence_threshold is None:
        persistence_threshold = 10 * hidden
    distinct = [(name, sizes) for name, sizes in modules if name not in tied]
    return ModelSizes(
        num_params=sum(sum(s) for _, s in distinct),
        largest_layer_params=max(sum(s) for _, s in modules),
        persistent_params=sum(n for _, s in distinct for n in s if n < persistence_threshold),
        hidden_size=hidden, source=source)


@dataclass(frozen=True)
class Estimate:
    """Bytes per tier per rank, what contributes what, and the minimum per device / node."""

    num_params: int
    largest_layer_params: int
    persistent_params: int
    world_size: int
    num_nodes: int
    precision: Precision
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
                 offload_optimizer=self._side("optimizer"), notes=list(self.notes))
        return d

    def format(self) -> str:
        lines = [
            f"offload estimate: {_count(self.num_params)} params, largest layer "
            f"{_count(self.largest_layer_params)}, persistent {_count(self.persistent_params)}; "
            f"{self.precision.value}, offload_param={self._side('param')}, "
            f"offload_optimizer={self._side('optimizer')}; "
            f"{self.world_size} rank(s) on {self.num_nodes} node(s)",
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
             "world_size": "--world-size", "num_nodes": "--num-nodes"}


def estimate(num_params: int | None = None, *, model_config: str | os.PathLike | Mapping | None = None,
             config: Config | Mapping | str | os.PathLike | None = None,
             largest_layer_params: int | None = None, persistent_params: int | None = None,
             world_size: int = 1, num_nodes: int = 1) -> Estimate:
    """Bytes per tier for `num_params` (or a HF model config) under `config`; see Note [memory model].

    world_size is the total number of ranks, num_nodes how many hosts they share.
    Without config: Config() (fp32, nothing offloaded).
    """
    return _estimate(num_params, model_config=model_config, config=config,
                     largest_layer_params=largest_layer_params, persistent_params=persistent_params,
                     world_size=world_size, num_nodes=num_nodes, names={})


def _estimate(num_params, *, model_config, config, largest_layer_params, persistent_params, world_size,
              num_nodes, names: Mapping[str, str]) -> Estimate:
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
    notes = []
    zero = cfg.zero_optimization
    threshold = zero.stage3_param_persistence_threshold
    if model_config is not None:
        if num_params is not None:
            raise ConfigError(f"estimate: give {name('num_params')} or {name('model_config')}, not both")
        sizes = model_sizes(model_config, None if threshold is AUTO else threshold)
        num_params, hidden = sizes.num_params, sizes.hidden_size
        if largest_layer_params is None:
            largest_layer_params = sizes.largest_layer_params
            notes.append(f"largest layer and persistent parameters counted from the {sizes.source}")
        if persistent_params is None:
            persistent_params = sizes.persistent_params
    else:
        if num_params is None:
            raise ConfigError(f"estimate: give {name('num_params')} or {name('model_config')}")
        hidden = None
        if isinstance(num_params, float) and num_params.is_integer():
            num_params = int(num_params)
        if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
            raise ConfigError(f"{name('num_params')}: {num_params!r} is not a positive integer")
        if largest_layer_params is None:
            largest_layer_params = math.ceil(num_params / LARGEST_LAYER_FRACTION)
            notes.append(f"largest layer not given: assumed {name('num_params')} / {LARGEST_LAYER_FRACTION} "
                         f"(give {name('largest_layer_params')} or {name('model_config')} for an exact figure)")
        if persistent_params is None:
            persistent_params = 0
            notes.append(f"persistent parameters not given: assumed 0 (give {name('persistent_params')}, "
                         f"or {name('model_config')} to count them)")
    for key, v in (("largest_layer_params", largest_layer_params), ("persistent_params", persistent_params)):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > num_params:
            raise ConfigError(f"{name(key)}: {v!r} is not an integer in [0, {num_params}] "
                              "(from 0 to the model's parameter count)")
    largest_layer_params, persistent_params = int(largest_layer_params), int(persistent_params)
    zero = zero.resolve_auto(hidden, num_params)

    c = cfg.precision.itemsize
    shard = math.ceil(num_params / world_size)
    p_dev, o_dev = zero.offload_param.device, zero.offload_optimizer.device
    p_tier, o_tier, grad_tier = p_dev.value, o_dev.value, zero.offload_optimizer.grad_tier.value
    prec = cfg.precision.value
    breakdown: dict[str, dict[str, int]] = {t: {} for t in TIERS}
    breakdown[p_tier][f"parameter shards ({prec}, {c} B/param)"] = shard * c
    breakdown[grad_tier]["gradient accumulation (fp32, 4 B/param)"] = shard * 4
    if c != 4:
        breakdown[o_tier]["fp32 master weights (4 B/param)"] = shard * 4
    breakdown[o_tier]["Adam exp_avg + exp_avg_sq (fp32, 8 B/param)"] = shard * 8
    breakdown["device"][f"gathered layers (2 x largest layer, {prec})"] = 2 * largest_layer_params * c
    breakdown["device"][f"persistent parameters ({prec}, whole on every rank)"] = persistent_params * c
    if p_dev is Tier.NVME:
        breakdown["host"][f"parameter NVMe bounce buffers (2 x largest layer, {prec})"] = \
            2 * largest_layer_params * c
    if o_dev is Tier.NVME:
        group = min(zero.sub_group_size, shard)
        breakdown["host"][f"optimizer NVMe swap buffers (2 x {group} elements x 16 B)"] = 2 * group * 16
    placement = None
    if zero.offload_param.auto or zero.offload_optimizer.auto:
        placement = _auto_plan(cfg, zero, num_params, largest_layer_params, persistent_params, world_size,
                               model_config, notes)
        for tier in TIERS:
            breakdown[tier] = {k: v for k, v in breakdown[tier].items()
                               if not k.startswith(("parameter shards", "fp32 master", "Adam exp_avg",
                                                    "gradient accumulation"))}
        for s in placement.shards:  # each gradient beside its optimizer state (grad_tier_of)
            what = breakdown[grad_tier_of(s.state).value]
            key = "gradient accumulation (fp32, 4 B/param)"
            what[key] = what.get(key, 0) + s.part_numel * 4
        for t, n in placement.home_bytes().items():
            if n:
                breakdown[t.value][f"parameter shards, planned ({prec}, {c} B/param)"] = n
        for t, n in placement.state_bytes().items():
            if n:
                breakdown[t.value]["optimizer state, planned (fp32 master + exp_avg + exp_avg_sq)"] = n
        if any(s.home is Tier.NVME for s in placement.shards):
            breakdown["host"][f"parameter NVMe bounce buffers (2 x largest layer, {prec})"] = \
                2 * largest_layer_params * c
        if any(s.state is Tier.NVME for s in placement.shards):
            breakdown["host"][f"optimizer state in flight ({_STATE_IN_FLIGHT} B x largest layer)"] = \
                _STATE_IN_FLIGHT * largest_layer_params
    totals = {t: sum(breakdown[t].values()) for t in TIERS}
    per_node = world_size // num_nodes
    return Estimate(
        num_params=num_params, largest_layer_params=largest_layer_params, persistent_params=persistent_params,
        world_size=world_size, num_nodes=num_nodes, precision=cfg.precision,
        offload_param=p_dev, offload_optimizer=o_dev, breakdown=breakdown, **totals,
        minimum_device=totals["device"], minimum_host=totals["host"] * per_node,
        minimum_nvme=totals["nvme"] * per_node, notes=tuple(notes), placement=placement,
        auto_param=zero.offload_param.auto, auto_optimizer=zero.offload_optimizer.auto)


# An auto plan's NVMe optimizer state in flight on the host: three of the
# largest partitions' state (12 B/param) and their masters (4), as initialize
# reserves them (offload/engine/budgets.py).
_STATE_IN_FLIGHT = 3 * 16


def _auto_plan(cfg, zero, num_params, largest, persistent, world_size, model_config, notes) -> Placement:
    """The plan an engine would make for "auto" (Note [automatic placement]): per
    parameter from --model-config, else the model cut into layers of the largest
    size; budgets from the memory section, else this machine's free host memory
    (the device gets memory.device_budget, or nothing: estimate does not open a GPU)."""
    import psutil

    itemsize = cfg.precision.itemsize
    if model_config is not None:
        modules, tied, _ = _module_params(_load_model_config(model_config)[0])
        numels = [(f"{name}.{i}", n) for name, sizes in modules if name not in tied for i, n in enumerate(sizes)]
    else:
        numels, left, i = [], num_params - persistent, 0
        while left > 0:
            numels.append((f"layer{i}", min(largest, left)))
            left, i = left - numels[-1][1], i + 1
        if persistent:
            numels.append(("persistent", persistent))
    threshold = zero.stage3_param_persistence_threshold
    specs = [ParamSpec(name, -(-n // world_size), -(-n // world_size) * world_size,
                       persistent=(n <= threshold if model_config is not None else name == "persistent"))
             for name, n in numels]
    mem = cfg.memory
    host = mem.host_budget
    if host is None:
        host = int(HOST_SHARE * psutil.virtual_memory().available)
        notes.append(f"auto placement: host budget {_gib(host)} ({HOST_SHARE:.0%} of this machine's available "
                     "memory; give memory.host_budget for another machine)")
    # What the engine holds besides homes and state comes first: the fp32
    # gradients and the bounce buffers on the host, the gathered layers on the device.
    shard = -(-num_params // world_size)
    host -= shard * 4 + 2 * largest * itemsize + _STATE_IN_FLIGHT * largest
    device = max(0, int(DEVICE_SHARE * (mem.device_budget or 0)) - persistent * itemsize)
    if mem.device_budget is None:
        notes.append("auto placement: no memory.device_budget, so no parameter is planned on the device "
                     "beyond the persistent ones (initialize takes half the GPU's free memory)")
    if host < 0:
        notes.append(f"auto placement: the host budget is {_gib(-host)} short of the gradients and buffers alone")
    budgets = Budgets(device=device, host=max(0, host),
                      nvme_homes=zero.offload_param.auto and zero.offload_param.nvme_path is not None,
                      nvme_state=zero.offload_optimizer.auto and zero.offload_optimizer.nvme_path is not None)
    return plan_placement(specs, budgets, itemsize=itemsize, separate_memory=True,
                          home_tier=None if zero.offload_param.auto else zero.offload_param.device,
                          state_tier=None if zero.offload_optimizer.auto else zero.offload_optimizer.device)


# --------------------------------------------------------------------------- CLI

_COUNT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A parameter count: "7e9", "7B", "1.3b", "350M", "125000000"."""
    m = _COUNT_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 7e9, 7B, 350M)")
    value = float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()]
    if value < 1 or not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole count")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `offload estimate`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=parse_count, help="parameter count (7e9, 7B, 350M)")
    src.add_argument("--model-config", help="a Hugging Face config.json (GPT-2 or Llama style)")
    parser.add_argument("--config", help="offload / DeepSpeed JSON config (default: fp32, nothing offloaded)")
    parser.add_argument("--largest-layer", type=parse_count, default=None,
                        help="parameters of the largest module (default: from --model-config, "
                             f"else --params / {LARGEST_LAYER_FRACTION})")
    parser.add_argument("--persistent-params", type=parse_count, default=None,
                        help="parameters kept whole on every device (default: from --model-config, else 0)")
    parser.add_argument("--world-size", type=int, default=1, help="total ranks (default 1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="hosts the ranks run on (default 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Runs `offload estimate`; 0 on success, 2 on a bad config or argument (message on stderr)."""
    try:
        est = _estimate(args.params, model_config=args.model_config, config=args.config,
                        largest_layer_params=args.largest_layer, persistent_params=args.persistent_params,
                        world_size=args.world_size, num_nodes=args.num_nodes, names=CLI_FLAGS)
    except ConfigError as exc:
        print(f"offload estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(est.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload estimate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
