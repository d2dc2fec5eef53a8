"""What the parameter runtime calls back into: one typed object, given to the
ParameterManager when it is built (never assigned afterwards). The frozen record
each backward hands the copy-down path is BackwardPlan (transfers/device_copies.py).

The runtime (this folder) sits below the step (offload/step): a gradient it
takes in, a forward it opens, an edit it writes home, are the step's business,
so it calls up through `StepHooks`, whose one implementation is the engine's
(offload/engine/hooks.py). Everything else flows down.
"""
from __future__ import annotations

from typing import Protocol

import torch


class StepHooks(Protocol):
    """The parameter runtime's calls up into the step, all in one place."""

    def take_grad(self, shard, grad: torch.Tensor, owned: bool = False, carried: bool = False,
                  master: torch.Tensor | None = None) -> None:
        """A parameter's final gradient (this rank's reduced partition): into its
        shard, and its update where one runs now (Note [update names] in offload/step/update_policy.py)."""

    def forward_starts(self) -> None:
        """A forward pass opens (Note [the model is the interface] in partition/manager.py)."""

    def edited(self, shard, master: torch.Tensor) -> None:
        """A partition edited outside training (offload.gathered): its fp32 value for the master."""

    def at_boundary(self) -> bool:
        """Whether this backward ends the accumulation window (Note [gradients across
        groups once a window] in transfers/grad_buckets.py)."""

    def brings_master(self, shard) -> bool:
        """Whether the parameter's partition goes down with its gradient (Note [masters
        down with their gradients] in transfers/device_copies.py)."""
