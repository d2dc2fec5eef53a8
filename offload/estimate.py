"""`offload estimate`: bytes per tier, and the minimum device, host and NVMe,
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
  Device, always: the largest layer gathered (c B per param, unsharded) twice
  (the one computing and the one prefetched), plus the persistent parameters
  (those under stage3_param_persistence_threshold, kept whole on every rank).
  Host bounce buffers: with offload_param nvme, 2 x largest layer x c; with
  offload_optimizer nvme, min(sub_group_size, trainable shard) x 16 B (master,
  m, v, grad) x 2 (double buffering).
Tiers are reported per rank; the minimum host and NVMe are per node (ranks per
node x per rank), the minimum device per device. docs/CONFIG.md compares this
with DeepSpeed's estimate_zero3_model_states_mem_needs term by term.

Note [trainable share]
`trainable` (`--trainable`) says how much of the model trains, as one of:
  a count ("8M", "3.4e6", an int) or a fraction ("0.011", "1.1%") of the
    model as --params / --model-config count it: the count is part of that
    total (for a LoRA, whose adapters are parameters added to the model, give
    the total with them, or give its adapter config);
  a PEFT LoRA adapter_config.json (or the folder holding it), with
    --model-config: the adapters are counted module by module as peft adds
    them (r x (in + out) per targeted Linear, GPT-2 Conv1D or Embedding; a
    DoRA magnitude and a lora_bias add `out`), on top of the base model,
    whose every parameter is frozen except the biases `bias` frees ("all":
    every one, "lora_only": the targeted modules'); each `modules_to_save`
    module is counted twice, as the frozen original and as peft's trainable
    copy. Matching follows peft (target_modules as suffixes or a regex over
    HF's module names, "all-linear" without the output layer,
    exclude_modules, layers_to_transform, rank_pattern); what the estimate
    cannot count (other peft types, target_parameters, trainable tokens) is
    refused rather than guessed.
The largest layer and the persistent parameters are counted with the
adapters (a LoRA's are small: most are persistent, kept whole on the device).
A count or fraction says how many train, not which. The closed form does not
need to know; an auto plan (`_auto_plan`) places each parameter, so it takes
the trainable share from the model's tail, whole parameters from the last one
back, the one that straddles the count split in two: the simplest split that
keeps both totals exact. The plan's tiers depend somewhat on which ones train
(the planner lifts trainable ones first, and a LoRA's are many small ones,
not a slice of the tail), so for a LoRA the adapter config gives the plan the
engine would make, a count an approximation of it.
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

    num_params: int             # distinct parameters (tied weights once), adapters included
    trainable_params: int       # of num_params, those that train (Note [trainable share])
    largest_layer_params: int   # the largest module's own parameters (DeepSpeed's definition)
    persistent_params: int      # parameters under the persistence threshold
    hidden_size: int | None
    source: str


@dataclass(frozen=True)
class _Module:
    """One module of a HF model and its own parameters, as a config.json describes it."""

    name: str  # HF's name below the model's prefix: "layers.0.self_attn.q_proj"
    sizes: tuple[int, ...]  # its own parameters' elements, the weight first
    kind: str = "norm"  # "linear" (nn.Linear, GPT-2's Conv1D), "embedding", "norm", or "adapter"
    features: tuple[int, int] = (0, 0)  # (in, out) of a linear; (num_embeddings, dim) of an embedding
    bias: bool = False  # its last parameter is a bias
    frozen: bool = False  # every parameter frozen but those `freed` lists
    freed: tuple[int, ...] = ()  # indices into sizes of the frozen module's trainable parameters (a bias)

    def trainable(self, i: int) -> bool:
        return not self.frozen or i in self.freed

    @property
    def trainable_numel(self) -> int:
        return sum(n for i, n in enumerate(self.sizes) if self.trainable(i))


@dataclass(frozen=True)
class _Model:
    """A model config's modules (adapters added, per Note [trainable share]) and what
    the estimate says about them."""

    modules: tuple[_Module, ...]
    tied: frozenset[str]  # modules whose parameters are another's (counted once)
    hidden: int
    source: str
    notes: tuple[str, ...] = ()

    def distinct(self):
        return [m for m in self.modules if m.name not in self.tied]

    def sizes(self, persistence_threshold: int | None) -> ModelSizes:
        if persistence_threshold is None:
            persistence_threshold = 10 * self.hidden
        distinct = self.distinct()
        return ModelSizes(
            num_params=sum(sum(m.sizes) for m in distinct),
            trainable_params=sum(m.trainable_numel for m in distinct),
            largest_layer_params=max(sum(m.sizes) for m in self.modules),
            persistent_params=sum(n for m in distinct for n in m.sizes if n < persistence_threshold),
            hidden_size=self.hidden, source=self.source)

    @property
    def largest_trainable(self) -> int:
        """The most trainable elements one module holds: what an update keeps in flight."""
        return max(m.trainable_numel for m in self.modules)


def _modules(cfg: Mapping) -> tuple[list[_Module], set[str], int, str]:
    """([modules in the model's order], modules whose params are tied to another, hidden,
    the prefix HF's module names have above them: "model." or "transformer.")."""
    def need(*keys):
        for key in keys:
            if key in cfg:
                v = cfg[key]
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise ConfigError(f"model config: {key}: {v!r} is not a positive integer")
                return v
        raise ConfigError(f"model config: missing {' or '.join(repr(k) for k in keys)}")

    def linear(name, i, o, bias=True):
        return _Module(name, (i * o, o) if bias else (i * o,), "linear", (i, o), bias)

    def embedding(name, num, dim):
        return _Module(name, (num * dim,), "embedding", (num, dim))

    model_type = cfg.get("model_type")
    modules: list[_Module] = []
    tied: set[str] = set()
    if model_type == "gpt2" or ("n_embd" in cfg and "hidden_size" not in cfg):
        h, n, v = need("n_embd"), need("n_layer"), need("vocab_size")
        positions = need("n_positions")
        inner = cfg.get("n_inner") or 4 * h

        def layer_norm(name):
            return _Module(name, (h, h), "norm", bias=True)
        modules += [embedding("wte", v, h), embedding("wpe", positions, h)]
        for i in range(n):  # GPT-2's Conv1D: a linear for LoRA, weights stored [in, out]
            modules += [layer_norm(f"h.{i}.ln_1"), linear(f"h.{i}.attn.c_attn", h, 3 * h),
                        linear(f"h.{i}.attn.c_proj", h, h), layer_norm(f"h.{i}.ln_2"),
                        linear(f"h.{i}.mlp.c_fc", h, inner), linear(f"h.{i}.mlp.c_proj", inner, h)]
        modules += [layer_norm("ln_f"), linear("lm_head", h, v, bias=False)]
        if cfg.get("tie_word_embeddings", True):
            tied.add("lm_head")
        return modules, tied, h, "transformer."
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

    modules.append(embedding("embed_tokens", v, h))
    for i in range(n):
        p = f"layers.{i}"
        modules += [linear(f"{p}.self_attn.q_proj", h, q, qkv_bias),
                    linear(f"{p}.self_attn.k_proj", h, kv, qkv_bias),
                    linear(f"{p}.self_attn.v_proj", h, kv, qkv_bias),
                    linear(f"{p}.self_attn.o_proj", q, h, o_bias),
                    linear(f"{p}.mlp.gate_proj", h, inter, mlp_bias),
                    linear(f"{p}.mlp.up_proj", h, inter, mlp_bias),
                    linear(f"{p}.mlp.down_proj", inter, h, mlp_bias),
                    _Module(f"{p}.input_layernorm", (h,)), _Module(f"{p}.post_attention_layernorm", (h,))]
    modules += [_Module("norm", (h,)), linear("lm_head", h, v, bias=False)]
    if cfg.get("tie_word_embeddings", False):
        tied.add("lm_head")
    return modules, tied, h, "model."


def _load_json(path: str | os.PathLike, what: str) -> dict:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {str(path)!r}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {str(path)!r}: not a text (JSON) file") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{what} {str(path)!r}: the top level is not a JSON object")
    return d


def _load_model_config(model_config: str | os.PathLike | Mapping) -> tuple[dict, str]:
    if isinstance(model_config, Mapping):
        return dict(model_config), "model config"
    return _load_json(model_config, "model config"), f"model config {Path(model_config).name}"


def _model(model_config: str | os.PathLike | Mapping, adapter: tuple[dict, str] | None = None,
           name: str = "trainable") -> _Model:
    """The model config's modules, with a LoRA adapter's added ((config, where from) or None:
    a full fine-tune). `name`: what errors call the adapter argument."""
    cfg, source = _load_model_config(model_config)
    modules, tied, hidden, prefix = _modules(cfg)
    if adapter is None:
        return _Model(tuple(modules), frozenset(tied), hidden, source)
    modules, notes = _lora(modules, prefix, cfg.get("model_type"), adapter[0], adapter[1], name)
    return _Model(tuple(modules), frozenset(tied), hidden, source, tuple(notes))


def model_sizes(model_config: str | os.PathLike | Mapping, persistence_threshold: int | None = None,
                adapter: str | os.PathLike | Mapping | None = None) -> ModelSizes:
    """Parameter counts of a GPT-2 or Llama-style HF `config.json` (a path or a dict),
    with a PEFT LoRA `adapter_config.json` (a path, its folder or a dict) added where
    given (Note [trainable share]).

    persistence_threshold None means the 'auto' value, 10 x hidden_size.
    """
    loaded = None if adapter is None else _adapter_config(adapter, "adapter")
    return _model(model_config, loaded, "adapter").sizes(persistence_threshold)


# --------------------------------------------------------------------------- the trainable share

# What `trainable` accepts, for its messages (Note [trainable share]).
_TRAINABLE_FORMS = ("a count of trainable parameters (8M, 3.4e6), a fraction of the model (0.011, or 1.1%) "
                    "or a PEFT LoRA adapter_config.json (with the model config)")
# peft's target_modules where a LoRA config leaves them null
# (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING).
_LORA_DEFAULT_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"],
                         "qwen2": ["q_proj", "v_proj"]}
# Keys of a LoRA config that would add trainable parameters the estimate does not
# count: refused when set rather than silently left out.
_LORA_UNCOUNTED = {"target_parameters": "LoRA on bare parameters, as for MoE experts",
                   "trainable_token_indices": "trainable token embeddings",
                   "layer_replication": "replicated layers"}
_PLAIN_DECIMAL = re.compile(r"^\s*[0-9]*\.[0-9]*\s*$")  # a decimal point, no exponent, no unit


@dataclass(frozen=True)
class _Share:
    """What `trainable` says (Note [trainable share]): one of a count, a fraction, or a
    LoRA adapter config with where it came from."""

    count: int | None = None
    fraction: float | None = None
    adapter: tuple[dict, str] | None = None

    def of(self, num_params: int, name: str) -> int:
        """Trainable elements of a model of num_params (a count or a fraction)."""
        if self.fraction is not None:
            count = round(self.fraction * num_params)
            if count < 1:
                raise ConfigError(f"{name}: {self.fraction:g} of the model's {num_params} parameters is less "
                                  "than one parameter; give a larger fraction or a count")
            return count
        if self.count > num_params:
            raise ConfigError(f"{name}: {self.count} trainable parameters is more than the model's {num_params} "
                              f"(a count is part of the model's total; give at most {num_params}, "
                              "or a fraction below 1)")
        return self.count


def _parse_trainable(value, name: str) -> _Share:
    """`trainable` as given (an int, a float, a string, a path or a dict) -> _Share."""
    def bad(why: str):
        return ConfigError(f"{name}: {value!r} {why}; expected {_TRAINABLE_FORMS}")

    if isinstance(value, Mapping):
        return _Share(adapter=(dict(value), "adapter config"))
    if isinstance(value, bool):
        raise bad("is a bool")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise bad("is negative" if value < 0 else "is not a finite number")
        if isinstance(value, float) and 0 < value < 1:
            return _Share(fraction=value)
        if value >= 1 and float(value).is_integer():
            return _Share(count=int(value))
        raise bad("is no parameter" if value == 0 else "is neither a whole count nor a fraction below 1")
    if isinstance(value, os.PathLike):
        return _Share(adapter=_adapter_config(value, name))
    if not isinstance(value, str):
        raise bad(f"is a {type(value).__name__}")
    text = value.strip()
    if text.startswith("-"):
        raise bad("is negative")
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise bad("is not a percentage") from None
        if not 0 < percent <= 100:
            raise bad("is not a percentage above 0 and at most 100")
        return _Share(fraction=percent / 100)
    if _PLAIN_DECIMAL.match(text) and text != ".":
        fraction = float(text)
        if not 0 < fraction < 1:
            # "2.0" could be a count or a fraction meant as a percentage: refuse, do not guess.
            raise bad("is not a fraction between 0 and 1 (a count is written whole: 8M, 3.4e6, 8000000)")
        return _Share(fraction=fraction)
    if _COUNT_RE.match(text):
        try:
            return _Share(count=parse_count(text))
        except argparse.ArgumentTypeError:
            raise bad("is not a positive whole count") from None
    if not text.lower().endswith(".json") and not os.path.exists(text):
        raise bad("is not a count, a fraction, or a file or folder that exists")
    return _Share(adapter=_adapter_config(text, name))


def _adapter_config(path: str | os.PathLike | Mapping, name: str) -> tuple[dict, str]:
    """A PEFT adapter config: a dict, an adapter_config.json, or the folder
    save_pretrained wrote it into -> (the config, what messages call it)."""
    if isinstance(path, Mapping):
        return dict(path), "adapter config"
    path = Path(path)
    if path.is_dir():
        path = path / "adapter_config.json"
    try:
        return _load_json(path, f"{name}: adapter config"), f"adapter config {str(path)!r}"
    except ConfigError as exc:
        raise ConfigError(f"{exc}; expected {_TRAINABLE_FORMS}") from None


def _lora(modules: list[_Module], prefix: str, model_type: str | None, adapter: dict,
          source: str, name: str) -> tuple[list[_Module], list[str]]:
    """The model's modules with a LoRA adapter config applied as peft applies it
    (Note [trainable share]): every base module frozen but the biases `bias` frees,
    each adapted module followed by its adapters, each saved one by its copy.
    `source`: what messages call the config; `name`: the argument it came from."""
    where = f"{name}: {source}"

    def fail(key: str, why: str):
        return ConfigError(f"{where}: {key}: {adapter.get(key)!r} {why}")

    def strings(key: str, *, one: bool) -> list[str] | str | None:
        v = adapter.get(key)
        if v is None or (one and isinstance(v, str)):
            return v
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise fail(key, "is not " + ("a string, " if one else "") + "a list of module names or null")
        return v

    def pattern(key: str, regex: str) -> re.Pattern:
        try:
            return re.compile(regex)
        except re.error as exc:
            raise fail(key, f"is not a valid regular expression ({exc})") from None

    peft_type = adapter.get("peft_type")
    if peft_type != "LORA":
        what = "no peft_type" if peft_type is None else f"peft_type {peft_type!r}"
        raise ConfigError(f"{where}: {what} is not supported: {name} counts LORA adapters only; "
                          f"give {name} the trainable count (e.g. 8M) or fraction (e.g. 0.011 or 1.1%) instead")
    for key, what in _LORA_UNCOUNTED.items():
        if adapter.get(key):
            raise ConfigError(f"{where}: {key}: {adapter[key]!r} ({what}) is not counted by the estimate; "
                              f"give {name} the trainable count or fraction instead")
    # peft's LoraConfig defaults, for keys a hand-written config leaves out. inference_mode
    # (true in what PeftModel.save_pretrained writes) is not read: this estimates training,
    # as PeftModel.from_pretrained(..., is_trainable=True) resumes it.
    r = adapter.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise fail("r", "is not a positive integer (the LoRA rank)")
    ranks = adapter.get("rank_pattern") or {}
    if not isinstance(ranks, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 1 for k, v in ranks.items()):
        raise fail("rank_pattern", "is not an object of module name patterns to positive ranks")
    for key in ranks:
        pattern("rank_pattern", rf"(.*\.)?({key})$")
    bias = adapter.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise fail("bias", "is not 'none', 'all' or 'lora_only'")
    flags = {}
    for key in ("use_dora", "lora_bias"):
        flags[key] = adapter.get(key, False)
        if not isinstance(flags[key], bool):
            raise fail(key, "is not true or false")
    if flags["use_dora"] and flags["lora_bias"]:
        raise fail("lora_bias", "is not supported with use_dora (peft refuses it)")
    targets = strings("target_modules", one=True)
    if targets is None:
        if model_type not in _LORA_DEFAULT_TARGETS:
            raise fail("target_modules", f"has no default for model_type {model_type!r}: name the modules")
        targets = _LORA_DEFAULT_TARGETS[model_type]
    exclude = strings("exclude_modules", one=True)
    to_save = strings("modules_to_save", one=False) or []
    layers = adapter.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool)) and not (
            isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise fail("layers_to_transform", "is not a layer index, a list of them, or null")
    layers_pattern = strings("layers_pattern", one=True)
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]

    def hf(m: _Module) -> str:  # the name peft matches: HF's, from the model's top
        return m.name if m.name == "lm_head" else prefix + m.name

    def above(key: str) -> list[str]:  # the modules holding it, outermost first
        parts = key.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    if isinstance(targets, str) and targets.lower() == "all-linear":
        # peft: every Linear / Conv1D but the output layer
        targets = [hf(m) for m in modules if m.kind == "linear" and m.name != "lm_head"]
    target_re = pattern("target_modules", targets) if isinstance(targets, str) else None
    exclude_re = pattern("exclude_modules", exclude) if isinstance(exclude, str) else None
    saved_re = [pattern("modules_to_save", rf"(^|.*\.){s}($|\..*)") for s in to_save]
    layer_res = [pattern("layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.") for p in layers_pattern or []] \
        or [re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")]

    def targeted(key: str) -> bool:  # peft's check_target_module_exists
        if exclude_re is not None and exclude_re.fullmatch(key):
            return False
        if isinstance(exclude, list) and (key in exclude or any(key.endswith(f".{e}") for e in exclude)):
            return False
        if any(p.match(key) for p in saved_re):  # never an adapter inside a saved module
            return False
        if target_re is not None:
            return bool(target_re.fullmatch(key))
        if not (key in targets or any(key.endswith(f".{t}") for t in targets)):
            return False
        if layers is None or layers == []:
            return True
        index = next((m.group("idx") for m in (p.match(key) for p in layer_res) if m), None)
        return index is not None and (int(index) == layers if isinstance(layers, int) else int(index) in layers)

    keys = [hf(m) for m in modules]
    holders = dict.fromkeys(k for key in keys for k in above(key))
    for key in holders:
        if targeted(key):
            raise ConfigError(f"{where}: target_modules matches {key!r}, a module holding others: LoRA adapts "
                              "Linear, GPT-2 Conv1D and Embedding modules (peft refuses it too)")
    out: list[_Module] = []
    adapted = copied = 0
    saved_found = set()
    for m, key in zip(modules, keys):
        is_target = targeted(key)
        if is_target and m.kind not in ("linear", "embedding"):
            raise ConfigError(f"{where}: target_modules matches {key!r}, a normalization layer: LoRA adapts "
                              "Linear, GPT-2 Conv1D and Embedding modules (peft refuses it too)")
        saves = [s for s in to_save if any(k.endswith(s) for k in above(key) + [key])]  # peft: a plain endswith
        saved_found.update(saves)
        # peft's bias: "all" frees every bias but those of a saved module's frozen original
        # (its wrapper keeps them frozen); "lora_only" those of the adapted modules.
        frees_bias = m.bias and ((bias == "all" and not saves) or (bias == "lora_only" and is_target))
        out.append(dataclasses.replace(m, frozen=True, freed=(len(m.sizes) - 1,) if frees_bias else ()))
        if is_target:
            rank = next((ranks[p] for p in ranks if re.match(rf"(.*\.)?({p})$", key)), r)
            i, o = m.features
            if m.kind == "linear":  # lora_A: in -> r, lora_B: r -> out (with its own bias where lora_bias)
                parts = [("lora_A", (rank * i,)), ("lora_B", (o * rank, o) if flags["lora_bias"] else (o * rank,))]
            elif flags["lora_bias"]:
                raise fail("lora_bias", f"is not supported for the embedding {key!r} (peft refuses it)")
            else:  # lora_embedding_A: r x num_embeddings, lora_embedding_B: dim x r
                parts = [("lora_embedding_A", (rank * i,)), ("lora_embedding_B", (o * rank,))]
            if flags["use_dora"]:
                parts.append(("lora_magnitude_vector", (o,)))
            out += [_Module(f"{m.name}.{part}", sizes, "adapter") for part, sizes in parts]
            adapted += 1
        if saves:
            out.append(_Module(f"{m.name}.modules_to_save", m.sizes, "adapter", m.features, m.bias))
            copied += 1
    if not adapted:
        raise fail("target_modules", "matches no Linear or Embedding module of the model (peft refuses it too)"
                   + (f" with exclude_modules {exclude!r}" if exclude else "")
                   + (f", modules_to_save {to_save!r}" if to_save else "")
                   + (f", layers_to_transform {layers!r}" if layers not in (None, []) else ""))
    notes = [f"{name}: LoRA from the {source}: r={r}, {adapted} modules adapted"
             + (f", {copied} saved (a frozen original and a trainable copy each)" if copied else "")
             + f", bias {bias!r}; every other base parameter frozen"]
    notes += [f"{name}: modules_to_save {s!r} matches no module of the model: nothing copied (peft skips it too)"
              for s in to_save if s not in saved_found]
    return out, notes


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
             "world_size": "--world-size", "num_nodes": "--num-nodes", "trainable": "--trainable"}


def estimate(num_params: int | None = None, *, model_config: str | os.PathLike | Mapping | None = None,
             config: Config | Mapping | str | os.PathLike | None = None,
             largest_layer_params: int | None = None, persistent_params: int | None = None,
             world_size: int = 1, num_nodes: int = 1,
             trainable: int | float | str | os.PathLike | Mapping | None = None) -> Estimate:
    """Bytes per tier for `num_params` (or a HF model config) under `config`; see Note [memory model].

    world_size is the total number of ranks, num_nodes how many hosts they share.
    trainable: how much of the model trains (Note [trainable share]): a count
    (8_000_000, "8M"), a fraction (0.011, "1.1%"), or a PEFT LoRA adapter config
    (a path to adapter_config.json or its folder, or the dict; needs model_config);
    None: all of it.
    Without config: Config() (fp32, nothing offloaded).
    """
    return _estimate(num_params, model_config=model_config, config=config,
                     largest_layer_params=largest_layer_params, persistent_params=persistent_params,
                     world_size=world_size, num_nodes=num_nodes, trainable=trainable, names={})


def _estimate(num_params, *, model_config, config, largest_layer_params, persistent_params, world_size,
              num_nodes, trainable, names: Mapping[str, str]) -> Estimate:
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
    share = None if trainable is None else _parse_trainable(trainable, name("trainable"))
    adapter = None if share is None else share.adapter
    notes = []
    zero = cfg.zero_optimization
    threshold = zero.stage3_param_persistence_threshold
    model = None
    if model_config is not None:
        if num_params is not None:
            raise ConfigError(f"estimate: give {name('num_params')} or {name('model_config')}, not both")
        model = _model(model_config, adapter, name("trainable"))
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
    shard = math.ceil(num_params / world_size)
    trainable_shard = math.ceil(trainable_params / world_size)
    frozen = trainable_params < num_params
    # Optimizer terms are per trainable element: said so where some are frozen.
    per = "B/trainable param" if frozen else "B/param"
    p_dev, o_dev = zero.offload_param.device, zero.offload_optimizer.device
    p_tier, o_tier, grad_tier = p_dev.value, o_dev.value, zero.offload_optimizer.grad_tier.value
    prec = cfg.precision.value
    breakdown: dict[str, dict[str, int]] = {t: {} for t in TIERS}
    if frozen:  # the frozen ones' home is all they cost (Note [frozen parameters] in offload/placement.py)
        breakdown[p_tier][f"parameter shards, trainable ({prec}, {c} B/param)"] = trainable_shard * c
        breakdown[p_tier][f"parameter shards, frozen ({prec}, {c} B/param, nothing else)"] = \
            (shard - trainable_shard) * c
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
    if o_dev is Tier.NVME:
        group = min(zero.sub_group_size, trainable_shard)
        breakdown["host"][f"optimizer NVMe swap buffers (2 x {group} elements x 16 B)"] = 2 * group * 16
    placement = None
    if zero.offload_param.auto or zero.offload_optimizer.auto:
        placement = _auto_plan(cfg, zero, num_params, trainable_params, largest_layer_params, largest_trainable,
                               persistent_params, world_size, model,
                               tail_share=share is not None and adapter is None, notes=notes, name=name)
        for tier in TIERS:
            breakdown[tier] = {k: v for k, v in breakdown[tier].items()
                               if not k.startswith(("parameter shards", "fp32 master", "Adam exp_avg",
                                                    "gradient accumulation"))}
        key = f"gradient accumulation (fp32, 4 {per})"
        for s in placement.shards:  # each gradient beside its optimizer state (grad_tier_of)
            if s.trainable:
                what = breakdown[grad_tier_of(s.state).value]
                what[key] = what.get(key, 0) + s.part_numel * 4
        homes = placement.home_bytes()
        frozen_homes = dataclasses.replace(placement, shards=tuple(s for s in placement.shards
                                                                   if not s.trainable)).home_bytes()
        for t in Tier:
            if frozen:
                if homes[t] - frozen_homes[t]:
                    breakdown[t.value][f"parameter shards, planned, trainable ({prec}, {c} B/param)"] = \
                        homes[t] - frozen_homes[t]
                if frozen_homes[t]:
                    breakdown[t.value][f"parameter shards, planned, frozen ({prec}, {c} B/param, nothing else)"] \
                        = frozen_homes[t]
            elif homes[t]:
                breakdown[t.value][f"parameter shards, planned ({prec}, {c} B/param)"] = homes[t]
        for t, n in placement.state_bytes().items():
            if n:
                breakdown[t.value]["optimizer state, planned (fp32 master + exp_avg + exp_avg_sq)"] = n
        if any(s.home is Tier.NVME for s in placement.shards):
            breakdown["host"][f"parameter NVMe bounce buffers (2 x largest layer, {prec})"] = \
                2 * largest_layer_params * c
        if any(s.state is Tier.NVME for s in placement.shards):
            layer = "largest trainable layer" if frozen else "largest layer"
            breakdown["host"][f"optimizer state in flight ({_STATE_IN_FLIGHT} B x {layer})"] = \
                _STATE_IN_FLIGHT * largest_trainable
    totals = {t: sum(breakdown[t].values()) for t in TIERS}
    per_node = world_size // num_nodes
    return Estimate(
        num_params=num_params, trainable_params=trainable_params, largest_layer_params=largest_layer_params,
        persistent_params=persistent_params, world_size=world_size, num_nodes=num_nodes, precision=cfg.precision,
        offload_param=p_dev, offload_optimizer=o_dev, breakdown=breakdown, **totals,
        minimum_device=totals["device"], minimum_host=totals["host"] * per_node,
        minimum_nvme=totals["nvme"] * per_node, notes=tuple(notes), placement=placement,
        auto_param=zero.offload_param.auto, auto_optimizer=zero.offload_optimizer.auto)


# An auto plan's NVMe optimizer state in flight on the host: three of the
# largest partitions' state (12 B/param) and their masters (4), as initialize
# reserves them (offload/engine/budgets.py).
_STATE_IN_FLIGHT = 3 * 16


def _auto_plan(cfg, zero, num_params, trainable_params, largest, largest_trainable, persistent, world_size,
               model: _Model | None, *, tail_share: bool, notes: list, name) -> Placement:
    """The plan an engine would make for "auto" (Note [automatic placement]): per
    parameter from --model-config, else the model cut into layers of the largest
    size; budgets from the memory section, else this machine's free host memory
    (the device gets memory.device_budget, or nothing: estimate does not open a GPU).
    tail_share: trainable_params is a count without the parameters it names, taken
    from the model's tail (Note [trainable share])."""
    import psutil

    itemsize = cfg.precision.itemsize
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
        notes.append(f"auto placement: {name('trainable')} says how many parameters train, not which: the plan "
                     "takes them from the model's tail")
    specs = [ParamSpec(pname, -(-n // world_size), -(-n // world_size) * world_size, persistent=pers,
                       trainable=train)
             for pname, n, pers, train in params]
    mem = cfg.memory
    host = mem.host_budget
    if host is None:
        host = int(HOST_SHARE * psutil.virtual_memory().available)
        notes.append(f"auto placement: host budget {_gib(host)} ({HOST_SHARE:.0%} of this machine's available "
                     "memory; give memory.host_budget for another machine)")
    # What the engine holds besides homes and state comes first: the fp32
    # gradients (of the trainable ones) and the bounce buffers on the host, the
    # gathered layers on the device.
    trainable_shard = -(-trainable_params // world_size)
    host -= trainable_shard * 4 + 2 * largest * itemsize + _STATE_IN_FLIGHT * largest_trainable
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
    # A string, parsed by estimate(): its errors name the flag and every accepted form.
    parser.add_argument("--trainable", default=None,
                        help="how much trains, the rest frozen: a count (8M, 3.4e6), a fraction (0.011, 1.1%%), "
                             "or a PEFT LoRA adapter_config.json or its folder (with --model-config; the adapters "
                             "are added to the model). Default: all of it")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    """Runs `offload estimate`; 0 on success, 2 on a bad config or argument (message on stderr)."""
    try:
        est = _estimate(args.params, model_config=args.model_config, config=args.config,
                        largest_layer_params=args.largest_layer, persistent_params=args.persistent_params,
                        world_size=args.world_size, num_nodes=args.num_nodes,
                        trainable=args.trainable, names=CLI_FLAGS)
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
