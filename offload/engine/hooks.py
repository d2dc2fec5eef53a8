"""The engine's side of the parameter runtime's StepHooks (partition/hooks.py) and of
the optimizer's UpdateDriver (optim/driver.py): both reach the step runner through it.

Held weakly: the manager and its hooks never keep an engine alive (Note [a
closed engine] in engine/closed.py); a call after the engine is gone raises
EngineClosedError.
"""
from __future__ import annotations

import weakref

import torch

from offload.engine.closed import EngineClosedError


class EngineHooks:
    """StepHooks and UpdateDriver for one engine: gradients and the optimizer's update to
    its step runner, a forward's start and an edit to the engine itself."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    def _get(self):
        engine = self._engine()
        if engine is None:
            raise EngineClosedError("its engine no longer exists (closed and collected)")
        return engine

    def take_grad(self, shard, grad: torch.Tensor, owned: bool = False, carried: bool = False,
                  master: torch.Tensor | None = None) -> None:
        self._get().step_runner.take_grad(shard, grad, owned=owned, carried=carried, master=master)

    def forward_starts(self) -> None:
        self._get()._forward_starts()

    def edited(self, shard, master: torch.Tensor) -> None:
        self._get()._on_edit(shard, master)

    def brings_master(self, shard) -> bool:
        return self._get().step_runner.brings_master(shard)

    def at_boundary(self) -> bool:
        return self._get().step_runner.is_boundary()

    # ---- UpdateDriver (the optimizer's side) ---------------------------------
    def update(self) -> None:
        self._get()._update()

    def settle(self) -> None:
        runner = self._get().__dict__.get("step_runner")
        if runner is not None:  # none yet while initialize places the shards: nothing runs
            runner.deferred.settle()

    def updating_in_backward(self) -> bool:
        runner = self._get().__dict__.get("step_runner")
        return runner is not None and runner.phases.updating_in_backward
