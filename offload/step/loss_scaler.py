"""Dynamic loss scaling for fp16 (DeepSpeed's `fp16` section semantics).

The loss is multiplied by `scale` before backward so small fp16 gradients do
not flush to zero. A step whose gradients hold an inf or NaN is skipped. The
first `hysteresis - 1` overflows after a scale increase are tolerated; from
then on every overflow halves the scale (never below `min_scale`). After
`window` consecutive clean steps the scale doubles and the tolerance is
restored. A static scale (`loss_scale` > 0 in the config) never changes.
"""
from __future__ import annotations

import logging

from offload.config import Precision

log = logging.getLogger("offload")


class LossScaler:
    @classmethod
    def of(cls, config) -> "LossScaler | None":
        """The config's fp16 loss scaler; None unless it trains in fp16."""
        if config.precision is not Precision.FP16:
            return None
        fp16 = config.fp16
        return cls(static_scale=fp16.loss_scale, initial_scale_power=fp16.initial_scale_power,
                   window=fp16.loss_scale_window, hysteresis=fp16.hysteresis, min_scale=fp16.min_loss_scale)

    def __init__(self, *, static_scale: float = 0.0, initial_scale_power: int = 16,
                 window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0):
        self.dynamic = static_scale == 0.0
        self.scale = 2.0 ** initial_scale_power if self.dynamic else float(static_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._overflows_left = hysteresis
        self._clean_steps = 0

    def update(self, overflow: bool, step: int) -> None:
        if not overflow:
            self._clean_steps += 1
            if self.dynamic and self._clean_steps % self.window == 0:
                self.scale *= 2.0
                self._overflows_left = self.hysteresis
            return
        self._clean_steps = 0
        if not self.dynamic:
            log.warning("step %d: fp16 gradient overflow with static loss scale %g; step skipped",
                        step, self.scale)
        elif self._overflows_left > 1:
            self._overflows_left -= 1
            log.warning("step %d: fp16 gradient overflow; step skipped, loss scale kept at %g "
                        "(hysteresis)", step, self.scale)
        else:
            old, self.scale = self.scale, max(self.scale / 2.0, self.min_scale)
            log.warning("step %d: fp16 gradient overflow; step skipped, loss scale %g -> %g",
                        step, old, self.scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "overflows_left": self._overflows_left,
                "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._overflows_left = state["overflows_left"]
        self._clean_steps = state["clean_steps"]
