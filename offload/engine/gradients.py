"""Step-wide checks over every gradient partition: the fp16 overflow check and
clipping by the global norm (the engine's deferred step, engine.py _update)."""
from __future__ import annotations

import math

import torch


def all_finite(shards) -> bool:
    """Whether every pending gradient is finite (fp16: an overflowed step is skipped)."""
    return all(bool(torch.isfinite(s.grad_part).all()) for s in shards if s.has_grad)


def clip_by_global_norm(shards, max_norm: float, device: torch.device, pg) -> float:
    """As torch.nn.utils.clip_grad_norm_: total 2-norm over every gradient,
    coefficient max_norm / (norm + 1e-6), applied only when below 1. Returns the norm."""
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for s in shards:
        if s.has_grad:
            sq += s.grad_part.float().pow(2).sum().to(device)
    total = math.sqrt(float(pg.sum_scalar(sq).item()))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for s in shards:
            if s.has_grad:
                s.grad_part.mul_(coef)
    return total
