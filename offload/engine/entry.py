"""The engine's entry point: `offload.initialize` (= `offload.engine.initialize`).

`initialize(model, config, weights=None, *, param_groups=None)` returns an Engine,
always. DeepSpeed's initialize, with its keywords and its 4-tuple, is the
DeepSpeed surface's: `offload.deepspeed.initialize` (offload/deepspeed/api.py).
Both make the engine with `create_engine` (offload/engine/create.py).
"""
from __future__ import annotations

import torch

from offload.engine.create import create_engine
from offload.engine.engine import Engine
from offload.optim.param_groups import torch_param_groups

# DeepSpeed's initialize keywords that are not ours: named in the error that sends a script there.
_DEEPSPEED_ONLY = frozenset({"args", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                             "distributed_port", "mpu", "dist_init_required", "collate_fn", "mesh_param",
                             "config_params"})


def initialize(model: torch.nn.Module | None = None, config=None, weights=None, *, param_groups=None,
               **deepspeed_keywords) -> Engine:
    """The model wrapped for training with its state spread over device, host and NVMe: an Engine.

    config: a dict, a JSON path or an offload.Config (docs/CONFIG.md). weights: values for
    the parameters, read one tensor at a time (offload/engine/weights.py). param_groups:
    torch's param groups (dicts with "params" and their own lr, betas, eps, weight_decay),
    or an iterable of the model's parameters; every trainable parameter in one.
    DeepSpeed's form, which returns (engine, optimizer, dataloader, lr_scheduler), is
    offload.deepspeed.initialize (`import offload.deepspeed as deepspeed`)."""
    if deepspeed_keywords or not isinstance(model, torch.nn.Module):
        given = sorted(set(deepspeed_keywords) & _DEEPSPEED_ONLY) or sorted(deepspeed_keywords)
        what = (f"initialize() got DeepSpeed's keyword(s) {given}" if deepspeed_keywords else
                f"initialize(model, config) takes a torch.nn.Module first, got {type(model).__name__}")
        raise TypeError(f"{what}: offload.initialize returns the Engine alone. DeepSpeed's initialize, "
                        "returning (engine, optimizer, dataloader, lr_scheduler), is offload.deepspeed.initialize "
                        "(`import offload.deepspeed as deepspeed`); param groups go to "
                        "offload.initialize(model, config, param_groups=...)")
    if config is None:
        raise TypeError("initialize(model, config): config is missing (a dict, a JSON path or an offload.Config)")
    groups = None
    if param_groups is not None:
        groups = torch_param_groups(model, param_groups)
    return create_engine(model, config, weights, param_groups=groups)
