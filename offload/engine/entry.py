"""The engine's entry point: `offload.initialize` (= `offload.engine.initialize`).

`initialize(model, config, weights=None)` returns an Engine; DeepSpeed's
keyword form (`initialize(model=..., model_parameters=..., ...)`) returns its
4-tuple through offload/engine/deepspeed_api.py. Both make the engine with
`create_engine` (offload/engine/create.py), which the DeepSpeed form calls
too, so neither of the two entry modules imports the other's caller.
"""
from __future__ import annotations

import torch

from offload.engine.create import create_engine
from offload.engine.engine import Engine


def initialize(*args, **kwargs) -> "Engine | tuple":
    """offload.initialize(model, config, weights=None) -> Engine: the model positional (create_engine).
    DeepSpeed's form, model= as a keyword (or DeepSpeed's positional order, args first) ->
    (engine, engine.optimizer, training dataloader or None, lr scheduler or None):
    offload/engine/deepspeed_api.py; docs/CONFIG.md, "DeepSpeed drop-in"."""
    if args and isinstance(args[0], torch.nn.Module):
        extra = set(kwargs) - {"config", "weights"}
        if extra:
            raise TypeError(f"initialize(model, config, weights=None) got {sorted(extra)}: DeepSpeed's form, "
                            "which returns (engine, optimizer, dataloader, lr_scheduler), takes model= as a keyword")
        return create_engine(*args, **kwargs)
    from offload.engine.deepspeed_api import initialize_deepspeed  # its imports only when asked for

    return initialize_deepspeed(*args, **kwargs)
