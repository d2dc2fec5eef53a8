"""How much of the model trains (`--trainable`): a count, a fraction, or a PEFT adapter config.

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
need to know; the plans (`_specs` in memory_model.py) place each parameter,
so they take the trainable share from the model's tail, whole parameters from the last one
back, the one that straddles the count split in two: the simplest split that
keeps both totals exact. The plan's tiers depend somewhat on which ones train
(the planner lifts trainable ones first, and a LoRA's are many small ones,
not a slice of the tail), so for a LoRA the adapter config gives the plan the
engine would make, a count an approximation of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from offload.config import ConfigError
from offload.sizing.hf_config import CountedModule, load_json


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
class TrainableShare:
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


def parse_trainable(value, name: str) -> TrainableShare:
    """`trainable` as given (an int, a float, a string, a path or a dict) -> TrainableShare."""
    def bad(why: str):
        return ConfigError(f"{name}: {value!r} {why}; expected {_TRAINABLE_FORMS}")

    if isinstance(value, Mapping):
        return TrainableShare(adapter=(dict(value), "adapter config"))
    if isinstance(value, bool):
        raise bad("is a bool")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise bad("is negative" if value < 0 else "is not a finite number")
        if isinstance(value, float) and 0 < value < 1:
            return TrainableShare(fraction=value)
        if value >= 1 and float(value).is_integer():
            return TrainableShare(count=int(value))
        raise bad("is no parameter" if value == 0 else "is neither a whole count nor a fraction below 1")
    if isinstance(value, os.PathLike):
        return TrainableShare(adapter=adapter_config(value, name))
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
        return TrainableShare(fraction=percent / 100)
    if _PLAIN_DECIMAL.match(text) and text != ".":
        fraction = float(text)
        if not 0 < fraction < 1:
            # "2.0" could be a count or a fraction meant as a percentage: refuse, do not guess.
            raise bad("is not a fraction between 0 and 1 (a count is written whole: 8M, 3.4e6, 8000000)")
        return TrainableShare(fraction=fraction)
    if _COUNT_RE.match(text):
        try:
            return TrainableShare(count=parse_count(text))
        except argparse.ArgumentTypeError:
            raise bad("is not a positive whole count") from None
    if not text.lower().endswith(".json") and not os.path.exists(text):
        raise bad("is not a count, a fraction, or a file or folder that exists")
    return TrainableShare(adapter=adapter_config(text, name))


def adapter_config(path: str | os.PathLike | Mapping, name: str) -> tuple[dict, str]:
    """A PEFT adapter config: a dict, an adapter_config.json, or the folder
    save_pretrained wrote it into -> (the config, what messages call it)."""
    if isinstance(path, Mapping):
        return dict(path), "adapter config"
    path = Path(path)
    if path.is_dir():
        path = path / "adapter_config.json"
    try:
        return load_json(path, f"{name}: adapter config"), f"adapter config {str(path)!r}"
    except ConfigError as exc:
        raise ConfigError(f"{exc}; expected {_TRAINABLE_FORMS}") from None


def lora_modules(modules: list[CountedModule], prefix: str, model_type: str | None, adapter: dict,
          source: str, name: str) -> tuple[list[CountedModule], list[str]]:
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

    def hf(m: CountedModule) -> str:  # the name peft matches: HF's, from the model's top
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
    out: list[CountedModule] = []
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
            out += [CountedModule(f"{m.name}.{part}", sizes, "adapter") for part, sizes in parts]
            adapted += 1
        if saves:
            out.append(CountedModule(f"{m.name}.modules_to_save", m.sizes, "adapter", m.features, m.bias))
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
