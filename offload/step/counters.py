"""The engine's step counters, in one object with its own state_dict.

Note [step counters]
  global_steps      updates applied (DeepSpeed's global_steps)
  micro_steps       step() calls, boundaries or not (DeepSpeed's micro_steps)
  skipped_steps     fp16 updates skipped for an overflow
  micro_in_window   step() calls since the last update: where in an
                    accumulation window the engine is
  scaled_passes     backward passes through engine.backward (loss scaled by
                    it) since the last update; the rest of the window's
                    passes went through loss.backward() (fp16 refuses those)
  passes_at_step    the manager's backward-pass count when step() last ran: a
                    step() with no backward since is a repeat, not a micro-step
  passes_at_update  ... when the last update ran
The first five are what a checkpoint saves (Note [saving inside an
accumulation window] in checkpoint_io/save.py); the pass marks are the
manager's count, which starts afresh in each process, so a load sets them
from it (load_state_dict).
"""
from __future__ import annotations

from dataclasses import dataclass

SAVED = ("global_steps", "micro_steps", "skipped_steps", "micro_in_window", "scaled_passes")


@dataclass
class StepCounters:
    global_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    micro_in_window: int = 0
    scaled_passes: int = 0
    passes_at_step: int = 0
    passes_at_update: int = 0

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in SAVED}

    def load_state_dict(self, state: dict, *, backward_passes: int, window: bool = True,
                        steps: bool = True) -> None:
        """Restores the saved counters. window=False: the accumulation window is not
        restored (its gradients were not loaded): the engine starts at its start.
        steps=False: the step counts stay (a module-only load). backward_passes: the
        manager's count now, which the pass marks are taken from."""
        if steps:
            self.global_steps = state["global_steps"]
            self.micro_steps = state["micro_steps"]
            self.skipped_steps = state["skipped_steps"]
        self.micro_in_window = state["micro_in_window"] if window else 0
        self.scaled_passes = state["scaled_passes"] if window and self.micro_in_window else 0
        self.passes_at_step = backward_passes
        self.passes_at_update = backward_passes - self.scaled_passes
