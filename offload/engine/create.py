"""create_engine: a model and its config made into an Engine, the one way both
initializes make one (offload's, offload/engine/entry.py, and DeepSpeed's,
offload/deepspeed/api.py)."""
from __future__ import annotations

import logging

import torch

from offload.config import Config
from offload.engine.engine import Engine
from offload.transfers.collectives import ProcessGroupInfo
from offload.torch_release import check_torch_release

log = logging.getLogger("offload")


def create_engine(model: torch.nn.Module, config, weights=None, *, param_groups=None) -> Engine:
    """Wraps `model` for training with its state spread over device, host and NVMe.

    config: a dict, a path to a JSON file, or an offload.Config (DeepSpeed's
    keys where the concept is the same; see docs/CONFIG.md).
    weights: values for the parameters (and buffers), read one tensor at a
    time: a state dict, a .safetensors or .bin/.pt file, or a Hugging Face
    directory (offload/engine/weights.py). Parameters on the meta device need
    them. A model built under offload.init(config) is adopted where it lies.
    """
    from offload.engine.init_context import claim

    check_torch_release()  # before anything moves: a torch we cannot train exactly on is named here
    config = Config.load(config)
    no_effect = config.no_effect_line()
    if no_effect is not None:
        log.warning(no_effect)  # once per initialize; Note [DeepSpeed keys] in offload/config/base.py
    if config.has_auto():
        hf_config = getattr(model, "config", None)
        hidden = getattr(hf_config, "hidden_size", None) or getattr(hf_config, "n_embd", None)
        num_params = sum(p.numel() for p in model.parameters())
        config = config.resolve_auto(hidden, max(num_params, 1),
                                     world_size=ProcessGroupInfo.current().world_size)
    else:  # DeepSpeed derives the batch size not given from the other two (only train_batch_size, say)
        config = config.resolve_batch(ProcessGroupInfo.current().world_size)
    builder = claim(model, config)
    try:
        return Engine(model, config, builder=builder, weights=weights, param_groups=param_groups)
    except BaseException:
        if builder is not None:
            builder.unclaim()  # refused before taking it over: initialize may be called again
        raise
