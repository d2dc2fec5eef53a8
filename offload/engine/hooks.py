"""The engine's side of the parameter runtime's StepHooks (partition/hooks.py).

Held weakly: the manager and its hooks never keep an engine alive (Note [a
closed engine] in engine/closed.py); a call after the engine is gone raises
EngineClosedError.
"""
from __future__ import annotations

import weakref

import torch

from offload.engine.closed import EngineClosedError


class EngineHooks:
    """StepHooks for one engine: gradients to its step runner, a forward's start and an
    edit to the engine itself."""

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
