"""Checking one user parameter group (torch's form) for ShardedAdam: Note [parameter groups]
in offload/optim/sharded_adam.py."""
from __future__ import annotations

import torch

# torch.optim.Adam/AdamW keys that change nothing here when false/None, and are refused when set.
OFF_ONLY = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")


def check_group(gi: int, param_group) -> tuple[list, dict]:
    """(params, hyperparameters) of group `gi`; lr, eps and weight_decay as floats, betas a pair.
    Other keys (a group's "name", say) are kept, as torch keeps them."""
    if not isinstance(param_group, dict) or "params" not in param_group:
        raise TypeError(f"parameter group {gi}: a dict with a 'params' list, got {type(param_group).__name__}")
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    hyper = {k: v for k, v in param_group.items() if k != "params"}
    for key in OFF_ONLY:
        if hyper.pop(key, None):
            raise ValueError(f"parameter group {gi}: {key}={param_group[key]!r} is not supported by the "
                             "engine's Adam (offload/ops); leave it unset")
    if "betas" in hyper:
        betas = hyper["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or \
                not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"parameter group {gi}: betas must be two numbers in [0, 1), got {betas!r}")
        hyper["betas"] = (float(betas[0]), float(betas[1]))
    for key in ("lr", "eps", "weight_decay"):
        if key in hyper:
            value = hyper[key]
            if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"parameter group {gi}: {key} must be a number >= 0, got {value!r}")
            hyper[key] = float(value)
    return params, hyper
