"""What the parameter runtime calls back into: one typed object, given to the
ParameterManager when it is built (never assigned afterwards), and the frozen
record each backward hands the copy-down path.

The runtime (this folder) sits below the step (offload/step): a gradient it
takes in, a forward it opens, an edit it writes home, are the step's business,
so it calls up through `StepHooks`, whose one implementation is the engine's
(offload/engine/hooks.py). Everything else flows down.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol

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

    def brings_master(self, shard) -> bool:
        """Whether the parameter's partition goes down with its gradient (Note [masters
        down with their gradients] in partition/device_copies.py)."""


@dataclass(frozen=True)
class BackwardPlan:
    """One backward's plan for the gradients going down, handed to GradientsToHost
    when the backward starts (GradientsToHost.begin_backward).

    carried: the updates of this backward may be carried under the next forward
    (Note [update names] in step/update_policy.py); each copy, as it starts, is then handed to
    `follow(shard, taken_in)`, so that its update runs right after the gradient is
    taken in, and backward's end does not wait for the copies (Note [head first
    after backward] in partition/device_copies.py)."""

    follow: Callable[[object, Future], None] | None = None

    @property
    def carried(self) -> bool:
        return self.follow is not None


NO_PLAN = BackwardPlan()  # a backward whose gradients are all in before step() reads them
