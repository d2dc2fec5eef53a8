"""What owns an optimizer's step, seen from the optimizer (Note [the optimizer users
drive] in optim/sharded_adam.py): a typed interface handed to ShardedAdam when it is
made, so the optimizer depends on it and not on the step layer above it. The engine's
StepRunner (offload/step/runner.py) answers it, through EngineHooks, which holds the
engine weakly (offload/engine/hooks.py)."""
from __future__ import annotations

from typing import Protocol


class UpdateDriver(Protocol):
    """The step that runs this optimizer's updates: during backward, under the next
    forward, or in step() (Note [update names] in step/update_policy.py)."""

    def update(self) -> None:
        """optimizer.step()'s whole update: fp16 unscaling and overflow skips, clipping,
        the schedule, and the update itself, wherever it runs."""

    def settle(self) -> None:
        """Returns once no update is running under the next forward (its first error raised):
        before anything reads or rewrites optimizer state outside the step."""

    def updating_in_backward(self) -> bool:
        """Whether updates started during the last backward and step() has not yet finished them."""
