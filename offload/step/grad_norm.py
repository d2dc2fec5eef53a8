"""The global gradient norm of the last update: one object owns it.

Note [global gradient norm]
get_global_grad_norm() is the 2-norm over every gradient the last update
applied, before clipping (torch.nn.utils.clip_grad_norm_'s return value).
With clipping on it is the clipping's own norm. With clipping off it is
summed in ShardedAdam.update_shard from each shard's gradient as its update
applies it (on the host worker when updates overlap backward, where no
later point still has the gradients), then summed over ranks when the step
completes; with one rank, when asked for or before the next update starts
(the updates may still run under the next forward; a device's terms are
read without waiting for it per step). The Adam kernel takes each block's squares right after its
update read the block (offload.ops.adam_step(sum_grad_squares=True)), from
cache: a second pass over the gradient, as this once was, read it from
memory again, 23% of the update's own time (16M elements, one core), on the
host worker's path that bounds backward beside a GPU. The sum is the
kernel's, in its own order (fp32 lanes, double across blocks): equal to
torch.linalg.vector_norm's to fp32 rounding, not bit for bit. The torch
fallback (no extension) and device-tier state take a separate pass.
With device-tier optimizer state each shard's term stays on the device (in
double), read once, when the norm is asked for: a read per shard waited for
the device each time (0.94B in bf16 on an H200: ~200 waits a step).
"""
from __future__ import annotations

import math

import torch

from offload.step.gradients import NormTerms


class GradNorm:
    """The last update's norm (Note [global gradient norm]) and this backward's norm
    terms (Note [norm terms during backward] in step/gradients.py)."""

    def __init__(self, optimizer, deferred, pg, device: torch.device, shards, account):
        """deferred: the updates left running under the next forward (step/updates.py), which add to the sum."""
        self._optimizer, self._deferred, self._pg, self._device = optimizer, deferred, pg, device
        self._shards, self._account = shards, account
        self.value: float | None = None
        self._pending = False  # left to sum once its updates ran
        self.terms: NormTerms | None = None  # this backward's, if taken
        self._scratch: NormTerms | None = None

    def take_terms(self, on: bool) -> None:
        """At a backward's start: whether its final gradients' terms are taken as they arrive."""
        if not on:
            self.terms = None
            return
        if self._scratch is None:
            self._scratch = NormTerms(max(s.part_numel for s in self._shards), self._account)
        self._scratch.clear()
        self.terms = self._scratch

    def taken_terms(self) -> NormTerms | None:
        """The terms this backward took (None: none), handed to the update once."""
        terms, self.terms = self.terms, None
        return terms

    def record(self, clipped_norm: float | None) -> None:
        """At each update: the clipping's norm, else the one the optimizer summed."""
        if clipped_norm is None and self._pg.world_size == 1 and not self._pending:
            # Summed when asked for, or before the next update starts: the updates may
            # go on under the next forward, and a device sum read now would wait for
            # the device (no collective: one rank).
            self._pending = True
            return
        if clipped_norm is None:
            self._deferred.settle()  # the sum is complete once every update ran
            dtype = torch.float64 if self._device.type == "cpu" else torch.float32
            sq = self._optimizer.grad_sq  # a device tensor where device-state updates added to it
            sq = (sq.reshape(1).to(self._device, dtype) if isinstance(sq, torch.Tensor)
                  else torch.tensor([sq], dtype=dtype, device=self._device))
            clipped_norm = math.sqrt(float(self._pg.sum_scalar(sq).item()))
        self.value = clipped_norm
        self._optimizer.grad_sq = 0.0

    def settle(self) -> None:
        """The last update's norm, where it was left to sum once its updates ran."""
        if self._pending:
            self._deferred.settle()
            self.record(None)
            self._pending = False
