"""Step-wide checks over every gradient partition: the fp16 overflow check and
clipping by the global norm (the update in step(): StepRunner.update,
step/runner.py).

Note [norm terms during backward]
Beside a separate device, a clipped step's per-shard sum of squares is taken
on the host worker as each final gradient is taken in (StepRunner.take_grad),
while backward goes on; step() then only adds the terms, in shard order, as
it would have computed them, and the coefficient is applied by each shard's
update on the host worker (DeferredUpdates.start). The same tensors and the
same operations in the same order: the same bits, off the compute thread.
Not with fp16 loss scaling, whose unscaling comes first.
"""
from __future__ import annotations

import math

import torch

from offload.tiers import Tier


def all_finite(shards) -> bool:
    """Whether every pending gradient is finite (fp16: an overflowed step is skipped)."""
    return all(bool(torch.isfinite(s.gradient.part).all()) for s in shards if s.gradient.pending)


def square_sum(grad_part: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One shard's term of the global norm. scratch: an fp32 buffer of at least its
    elements for the squares (the same values as pow's own result, so the same sum)."""
    g = grad_part.float()
    if scratch is None or not g.is_contiguous() or g.device != scratch.device:
        return g.pow(2).sum()
    return torch.pow(g, 2, out=scratch[:g.numel()].view(g.shape)).sum()


class NormTerms(dict):
    """shard index -> square_sum, taken as final gradients arrive (Note [norm terms
    during backward]), with one scratch buffer for the squares, made at the first
    term and kept: a fresh temporary per shard cost a page fault per 4 KiB (849k
    a step, GPT 0.94B on an H200 host)."""

    def __init__(self, largest: int, account):
        super().__init__()
        self._largest, self._account, self._scratch = largest, account, None

    def take(self, shard) -> None:
        if shard.gradient.tier is Tier.DEVICE:  # on the compute thread, where the gradient is
            self[shard.index] = square_sum(shard.gradient.part)
            return
        if self._scratch is None:
            self._account.charge(Tier.HOST, self._largest * 4, "gradient norm scratch")
            self._scratch = torch.empty(self._largest, dtype=torch.float32)
        self[shard.index] = square_sum(shard.gradient.part, self._scratch)


def clip_coefficient(shards, max_norm: float, device: torch.device, pg,
                     terms: dict | None = None) -> tuple[float, float | None]:
    """As torch.nn.utils.clip_grad_norm_: the total 2-norm over every gradient, and the
    coefficient max_norm / (norm + 1e-6) where it is below 1 (else None). terms: shard
    index -> square_sum already taken (Note [norm terms during backward])."""
    terms = terms or {}
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for s in shards:
        if s.gradient.pending:
            term = terms.get(s.index)
            sq += (term if term is not None else square_sum(s.gradient.part)).to(device)
    total = math.sqrt(float(pg.sum_scalar(sq).item()))
    coef = max_norm / (total + 1e-6)
    return total, (coef if coef < 1.0 else None)


def clip_by_global_norm(shards, max_norm: float, device: torch.device, pg) -> float:
    """Clips every pending gradient in place (clip_coefficient); returns the norm."""
    total, coef = clip_coefficient(shards, max_norm, device, pg)
    if coef is not None:
        for s in shards:
            if s.gradient.pending:
                s.gradient.part.mul_(coef)
    return total


# Note [updates from the staging buffer]
# Beside a separate device, a gradient the host worker has just taken in from
# its pinned staging buffer (Note [the host worker]) and that is the window's
# only one is updated from that buffer, which is released after the update:
# copying it into the fp32 partition first was a pass over 4 bytes a
# parameter on the worker's serial path (0.94B: 3.8 GB a step). A bf16
# gradient too: the kernel widens bf16 to fp32 as it loads it, exactly as
# the copy into the fp32 partition would (a bf16 value is an fp32 value with
# 16 low bits zero), so the update and its norm term are the same bit for
# bit, and the widening pass (6 bytes a parameter; on an H200 host at 0.94B
# in bf16 about a third of the worker's serial path) is gone. Not fp16: its
# gradient is unscaled and checked for overflow before any update. State on
# the host and no home on NVMe, so the update cannot fail and leave the
# gradient in a buffer about to be reused (and if it did not run, the
# gradient goes into the partition after all).
# UpdatePolicy.from_staging (step/update_policy.py) decides it.
