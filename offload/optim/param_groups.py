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


def torch_param_groups(model, model_parameters) -> list[dict] | None:
    """torch's param groups (or an iterable of the model's parameters) as the engine's,
    {"params": [names], hyperparameters...} (Note [parameter groups] in
    offload/optim/sharded_adam.py); None for None. Every trainable parameter must be listed."""
    if model_parameters is None:
        return None
    if isinstance(model_parameters, torch.nn.Module):
        raise TypeError("model_parameters: an iterable of parameters or of param-group dicts, not a module")
    entries = list(model_parameters)
    if not entries:
        raise ValueError("model_parameters is empty")
    if all(isinstance(e, dict) for e in entries):
        groups = entries
    elif any(isinstance(e, dict) for e in entries):
        raise TypeError("model_parameters mixes parameters and param-group dicts; give one kind")
    else:
        groups = [{"params": entries}]
    names = {id(p): n for n, p in model.named_parameters()}
    out, listed = [], set()
    for gi, group in enumerate(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if params is None:
            raise TypeError(f"model_parameters group {gi}: a dict with a 'params' list")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) not in names:
                raise ValueError(f"model_parameters group {gi}: a tensor of shape {tuple(p.shape)} that is not "
                                 "a parameter of the model")
        listed.update(id(p) for p in params)
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in params]})
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in listed]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(
            f"model_parameters leaves out {len(left)} trainable parameter(s): {shown}. DeepSpeed would compute "
            "their gradients and never apply them; set requires_grad=False on them for the same training "
            "without the wasted gradients, or list them")
    return out
