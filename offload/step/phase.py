"""Where an engine is in its training step: one enum, one owner (the Engine).

Note [step phases]
  READY                   no update in flight: a forward, a backward, a checkpoint may start
  UPDATING_IN_BACKWARD    a backward that ends an accumulation window started the updates
                          (Note [optimizer overlap] in step/updates.py): step() must come next,
                          and nothing but it (or a failed backward's abandon) ends them
  UPDATING_DEFERRED  step() left the updates running on the host worker (Note [updates
                          under the next forward]): each read of a shard waits for its own
                          update; the next backward settles them all
  FAILED                  an update raised (Note [a failed step]): step() retries it,
                          load_checkpoint() restores; a forward or backward is refused
Bytes: in both UPDATING phases the gradients still held count on the gradient
tier until their update has run; FAILED keeps the gradients of the shards not
updated and, in the store, the values whose write failed.
"""
from __future__ import annotations

import enum


class StepPhase(enum.Enum):
    READY = "ready"
    UPDATING_IN_BACKWARD = "updating in backward"
    UPDATING_DEFERRED = "updates deferred under the next forward"
    FAILED = "failed"


class StepPhases:
    """The engine's phase and its transitions, each named for the phase it enters and
    checking the phase it leaves (a transition from elsewhere is the engine's bug)."""

    def __init__(self):
        self.phase = StepPhase.READY
        self.failure: tuple[BaseException, float | None] | None = None  # (error, clipped norm) while FAILED

    def _leave(self, *allowed: StepPhase) -> None:
        if self.phase not in allowed:
            raise AssertionError(f"step phase {self.phase.value!r}: expected one of "
                                 f"{', '.join(p.value for p in allowed)}")

    def to_ready(self, *leaving: StepPhase) -> None:
        """Back to READY from one of `leaving`, which each caller names (the phases its
        path can be in: a step's end, a retry, an abandon, a load)."""
        if not leaving:
            raise TypeError("to_ready() names the phases it may leave")
        self._leave(*leaving)
        self.phase, self.failure = StepPhase.READY, None

    def to_updating_in_backward(self) -> None:
        self._leave(StepPhase.READY)
        self.phase = StepPhase.UPDATING_IN_BACKWARD

    def to_updating_deferred(self) -> None:
        self._leave(StepPhase.READY, StepPhase.UPDATING_DEFERRED)  # a step without a backward between
        self.phase = StepPhase.UPDATING_DEFERRED

    def to_failed(self, error: BaseException, clipped_norm: float | None) -> None:
        self._leave(StepPhase.READY, StepPhase.UPDATING_IN_BACKWARD, StepPhase.FAILED)
        self.phase, self.failure = StepPhase.FAILED, (error, clipped_norm)

    @property
    def updating_in_backward(self) -> bool:
        return self.phase is StepPhase.UPDATING_IN_BACKWARD

    @property
    def failed(self) -> bool:
        return self.phase is StepPhase.FAILED
