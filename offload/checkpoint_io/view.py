"""What checkpoints read of an engine: one frozen record, made by Engine.checkpoint_view().

checkpoint_io never reaches into the Engine itself: each part here is the owner
of what it saves (the step runner its counters and loss scale, the optimizer
its state, the shards their values), and this record is the whole contract.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class CheckpointView:
    module: torch.nn.Module
    config: object  # offload.Config
    shards: list
    optimizer: object  # ShardedAdam
    step: object  # StepRunner: counters, loss scale, LR schedule, gradients
    manager: object  # ParameterManager: released before homes are rewritten; its backward count
    pg: object  # ProcessGroupInfo
    compute_dtype: torch.dtype
    swap_stores: tuple
    param_group_names: list | None  # the groups initialize was given, by parameter name (None: one group)
    frozen_fingerprints: dict  # Note [checkpoints without frozen weights] in checkpoint_io/frozen.py
    full_value: Callable  # (shard, master=False) -> the parameter's full value on the host

    @property
    def lr_scheduler(self):
        return self.step.lr_scheduler
