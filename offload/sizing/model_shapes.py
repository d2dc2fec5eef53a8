"""What the estimate needs from a model (ModelSizes): from a Hugging Face config.json, with a
PEFT adapter's modules added where one is given."""
from __future__ import annotations

import os
from typing import Mapping

from offload.sizing.hf_config import CountedModel, ModelSizes, count_modules, load_model_config
from offload.sizing.trainable import adapter_config, lora_modules


def counted_model(model_config: str | os.PathLike | Mapping, adapter: tuple[dict, str] | None = None,
           name: str = "trainable") -> CountedModel:
    """The model config's modules, with a LoRA adapter's added ((config, where from) or None:
    a full fine-tune). `name`: what errors call the adapter argument."""
    cfg, source = load_model_config(model_config)
    modules, tied, hidden, prefix = count_modules(cfg)
    if adapter is None:
        return CountedModel(tuple(modules), frozenset(tied), hidden, source)
    modules, notes = lora_modules(modules, prefix, cfg.get("model_type"), adapter[0], adapter[1], name)
    return CountedModel(tuple(modules), frozenset(tied), hidden, source, tuple(notes))


def model_sizes(model_config: str | os.PathLike | Mapping, persistence_threshold: int | None = None,
                adapter: str | os.PathLike | Mapping | None = None) -> ModelSizes:
    """Parameter counts of a GPT-2 or Llama-style HF `config.json` (a path or a dict),
    with a PEFT LoRA `adapter_config.json` (a path, its folder or a dict) added where
    given (Note [trainable share]).

    persistence_threshold None means the 'auto' value, 10 x hidden_size.
    """
    loaded = None if adapter is None else adapter_config(adapter, "adapter")
    return counted_model(model_config, loaded, "adapter").sizes(persistence_threshold)
