"""A Hugging Face config.json read module by module, as the estimate counts a model: each
module's parameters, which are tied, the largest layer."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from offload.config import ConfigError


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
class CountedModule:
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
class CountedModel:
    """A model config's modules (adapters added, per Note [trainable share]) and what
    the estimate says about them."""

    modules: tuple[CountedModule, ...]
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


def count_modules(cfg: Mapping) -> tuple[list[CountedModule], set[str], int, str]:
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
        return CountedModule(name, (i * o, o) if bias else (i * o,), "linear", (i, o), bias)

    def embedding(name, num, dim):
        return CountedModule(name, (num * dim,), "embedding", (num, dim))

    model_type = cfg.get("model_type")
    modules: list[CountedModule] = []
    tied: set[str] = set()
    if model_type == "gpt2" or ("n_embd" in cfg and "hidden_size" not in cfg):
        h, n, v = need("n_embd"), need("n_layer"), need("vocab_size")
        positions = need("n_positions")
        inner = cfg.get("n_inner") or 4 * h

        def layer_norm(name):
            return CountedModule(name, (h, h), "norm", bias=True)
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
                    CountedModule(f"{p}.input_layernorm", (h,)), CountedModule(f"{p}.post_attention_layernorm", (h,))]
    modules += [CountedModule("norm", (h,)), linear("lm_head", h, v, bias=False)]
    if cfg.get("tie_word_embeddings", False):
        tied.add("lm_head")
    return modules, tied, h, "model."


def load_json(path: str | os.PathLike, what: str) -> dict:
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


def load_model_config(model_config: str | os.PathLike | Mapping) -> tuple[dict, str]:
    if isinstance(model_config, Mapping):
        return dict(model_config), "model config"
    path = Path(model_config)
    if path.is_dir():  # a model's folder, as from_pretrained takes it: its config.json
        if not (path / "config.json").is_file():
            raise ConfigError(f"model config: {path} is a folder without a config.json; give the model's "
                              "config.json, or the folder that holds it")
        path = path / "config.json"
    return load_json(path, "model config"), f"model config {path.name}"
