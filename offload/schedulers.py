"""DeepSpeed's learning-rate schedules as torch LR schedulers.

    sched = build_scheduler(optimizer, config.scheduler)
    for batch in data:
        ...; optimizer.step(); sched.step()

WarmupLR, WarmupDecayLR and WarmupCosineLR give, step for step, the learning
rates DeepSpeed 0.19.8's schedulers of the same name give (tested element by
element against them). Our own code, written from their formulas:

Note [DeepSpeed step offset]: DeepSpeed counts `last_batch_iteration` from -1
(the value at construction) and its first `step()` makes it 0. torch's
LRScheduler steps once in its constructor, so its `last_epoch` is 0 there.
Hence DeepSpeed's iteration is `last_epoch - 1` here, and iteration -1 (before
the first step) gives warmup_min_lr (WarmupLR, WarmupDecayLR) or 0
(WarmupCosineLR), as in DeepSpeed.

WarmupLR and WarmupDecayLR set the learning rate absolutely: the optimizer's
own lr is ignored, except that WarmupLR with no warmup_max_lr rises to the
optimizer's lr (DeepSpeed does the same). WarmupCosineLR scales the
optimizer's lr by a ratio. The warmup length is at least 2 steps, and the
arithmetic is done in DeepSpeed's order (`(1 / log n) * log(i + 1)`, not
`log(i + 1) / log n`), so the floats are the same, not just close.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch.optim.lr_scheduler import LRScheduler

from offload.config import (
    SchedulerConfig,
    SchedulerType,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    WarmupType,
)

__all__ = ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]


def _warmup_fraction(iteration: int, warmup_steps: int, inverse_log: float, kind: WarmupType) -> float:
    """The warmup's progress in [0, 1) at `iteration` < warmup_steps."""
    if kind is WarmupType.LOG:
        return inverse_log * math.log(iteration + 1)
    return iteration / warmup_steps


class _DeepSpeedSchedule(LRScheduler):
    """Absolute per-iteration learning rates; subclasses give `_lr_at(iteration, base_lr)`."""

    def __init__(self, optimizer: torch.optim.Optimizer, params, last_epoch: int = -1):
        self.params = params
        self.warmup_steps = max(2, params.warmup_num_steps)
        self.inverse_log = 1.0 / math.log(self.warmup_steps)
        super().__init__(optimizer, last_epoch)

    def _lr_at(self, iteration: int, base_lr: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        iteration = self.last_epoch - 1  # Note [DeepSpeed step offset]
        return [self._lr_at(iteration, base) for base in self.base_lrs]

    _get_closed_form_lr = get_lr


class WarmupLR(_DeepSpeedSchedule):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(self, optimizer, params: WarmupLRParams, last_epoch: int = -1):
        super().__init__(optimizer, params, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_steps:
            return _warmup_fraction(iteration, self.warmup_steps, self.inverse_log, self.params.warmup_type)
        return 1.0

    def _lr_at(self, iteration: int, base_lr: float) -> float:
        p = self.params
        min_lr = p.warmup_min_lr
        if iteration < 0:
            return min_lr
        max_lr = base_lr if p.warmup_max_lr is None else p.warmup_max_lr
        return min_lr + (max_lr - min_lr) * self._gamma(iteration)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr to 0 at total_num_steps (and 0 after)."""

    def __init__(self, optimizer, params: WarmupDecayLRParams, last_epoch: int = -1):
        _DeepSpeedSchedule.__init__(self, optimizer, params, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_steps:
            return _warmup_fraction(iteration, self.warmup_steps, self.inverse_log, self.params.warmup_type)
        total = self.params.total_num_steps
        return max(0.0, float(total - iteration) / float(max(1.0, total - self.warmup_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """lr * ratio: warmup_min_ratio -> 1 over warmup_num_steps, then a cosine down to
    cos_min_ratio at total_num_steps, where it stays."""

    def __init__(self, optimizer, params: WarmupCosineLRParams, last_epoch: int = -1):
        super().__init__(optimizer, params, last_epoch)

    def _ratio(self, iteration: int) -> float:
        p = self.params
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_steps:
            ratio = _warmup_fraction(iteration, self.warmup_steps, self.inverse_log, p.warmup_type)
            return p.warmup_min_ratio + ratio * (1.0 - p.warmup_min_ratio)
        done = iteration - self.warmup_steps + 1
        span = max(1, p.total_num_steps - self.warmup_steps)
        progress = min(1.0, done / span)  # clamped: stays at cos_min_ratio past the end
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, p.cos_min_ratio + (1.0 - p.cos_min_ratio) * ratio)

    def _lr_at(self, iteration: int, base_lr: float) -> float:
        return base_lr * self._ratio(iteration)


_SCHEDULERS = {
    SchedulerType.WARMUP_LR: WarmupLR,
    SchedulerType.WARMUP_DECAY_LR: WarmupDecayLR,
    SchedulerType.WARMUP_COSINE_LR: WarmupCosineLR,
}


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig | Mapping) -> LRScheduler:
    """The scheduler `config` (a SchedulerConfig, or its DeepSpeed-style dict) describes."""
    if isinstance(config, Mapping):
        config = SchedulerConfig.from_dict(config)
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"build_scheduler: config is a {type(config).__name__}, not a SchedulerConfig or dict")
    return _SCHEDULERS[config.type](optimizer, config.params)
