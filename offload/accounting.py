"""Bytes held per tier, now and at peak, as the engine itself allocates them.

Every buffer the engine creates on a tier is charged here when allocated and
credited when freed, so `Engine.memory_report()` and the budget checks read
one source of truth. A charge that would pass the tier's budget raises
TierBudgetError naming the tier, the request and what is held: the budget is
a promise made at initialize, and breaking it mid-step is a bug to surface,
not to hide.

One ledger shape: whatever counts bytes against a budget takes
`charge(nbytes, what)` and `credit(nbytes)` and answers `usage()` with a
TierUsage (now, peak, budget): a tier of the account (`account.ledger(tier)`,
what the I/O layer is handed) and the engine's page-locked bytes
(offload/aio/buffer_pool.py PinnedLedger, part of the host tier) alike.

Reclaimers (`add_reclaimer`) hold bytes the step can do without (the
prefetcher's reads ahead and parameters kept for reuse): a charge that would
pass the budget first asks them to give bytes back, then is tried once more
(Note [prefetch within the device budget] in offload/partition/prefetch.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from offload.tiers import Tier


class TierBudgetError(MemoryError):
    """A tier's budget (memory.device_budget, host_budget, pinned_budget) exceeded: at
    initialize by what the plan would hold, or mid-step by a charge; the message names
    the tier, the bytes and what to change."""


@dataclass
class TierUsage:
    now: int = 0
    peak: int = 0
    budget: int | None = None


class Ledger(Protocol):
    """The one shape of a byte count kept within a budget."""

    def charge(self, nbytes: int, what: str) -> None:
        """Counts nbytes more, for `what`; TierBudgetError where the budget has no room."""

    def credit(self, nbytes: int) -> None:
        """Counts nbytes freed."""

    def usage(self) -> TierUsage:
        """Now, peak and budget."""


class MemoryAccount:
    def __init__(self, budgets: dict[Tier, int | None] | None = None):
        budgets = budgets or {}
        self._lock = threading.Lock()
        self._usage = {tier: TierUsage(budget=budgets.get(tier)) for tier in Tier}
        self._settlers: list = []
        self._reclaimers: dict[Tier, object] = {}
        # Per tier, what initialize reserved out of the budget, said in a refusal
        # (engine/budgets.py `tier_needs` and `check_needs`, called by engine/build.py).
        self.budget_notes: dict[Tier, str] = {}
        # The engine's page-locked host bytes (offload.aio.buffer_pool.PinnedLedger:
        # now, peak, budget), set by engine/build.py; part of the host tier, not a tier.
        self.pinned = None

    def add_reclaimer(self, tier: Tier, reclaim) -> None:
        """reclaim(nbytes): frees up to about nbytes of optional holdings on `tier`
        (credited through credit()); called when a charge would pass the budget."""
        self._reclaimers[tier] = reclaim

    def remove_reclaimer(self, tier: Tier) -> None:
        self._reclaimers.pop(tier, None)

    def drop_callbacks(self) -> None:
        """The engine is closing: forgets its settlers and reclaimers (each holds an
        object that holds this account: no cycle is left for the garbage collector)."""
        self._settle()
        self._settlers.clear()
        self._reclaimers.clear()

    def fits(self, tier: Tier, nbytes: int) -> bool:
        """Whether nbytes more can be charged to `tier` now without reclaiming anything."""
        self._settle()
        with self._lock:
            usage = self._usage[tier]
            return usage.budget is None or usage.now + nbytes <= usage.budget

    def add_settler(self, settle) -> None:
        """settle() is called before every charge and read: it credits bytes freed
        since its last call (Note [credits owed by the garbage collector] in
        offload/activations/saver.py)."""
        self._settlers.append(settle)

    def _settle(self) -> None:
        for settle in self._settlers:
            settle()

    def charge(self, tier: Tier, nbytes: int, what: str) -> None:
        self._settle()
        reclaim = self._reclaimers.get(tier)
        while True:
            with self._lock:
                usage = self._usage[tier]
                if usage.budget is None or usage.now + nbytes <= usage.budget:
                    usage.now += nbytes
                    usage.peak = max(usage.peak, usage.now)
                    return
                short, held, budget = usage.now + nbytes - usage.budget, usage.now, usage.budget
            if reclaim is None:
                note = self.budget_notes.get(tier)
                raise TierBudgetError(
                    f"{tier.value} tier budget exceeded allocating {nbytes} bytes for {what}: "
                    f"{held} of {budget} bytes already held" + (f"; {note}" if note else ""))
            reclaim(short)
            reclaim = None  # once: what it could not free stays held

    def credit(self, tier: Tier, nbytes: int) -> None:
        with self._lock:
            usage = self._usage[tier]
            usage.now -= nbytes
            assert usage.now >= 0, f"{tier.value} tier accounting went negative"

    def usage(self, tier: Tier) -> TierUsage:
        self._settle()
        with self._lock:
            u = self._usage[tier]
            return TierUsage(now=u.now, peak=u.peak, budget=u.budget)

    def reset_peak(self) -> None:
        self._settle()
        with self._lock:
            for u in self._usage.values():
                u.peak = u.now
        if self.pinned is not None:
            self.pinned.reset_peak()

    def report(self) -> dict[str, dict[str, int | None]]:
        """Per tier (by its value) now, peak and budget; under "pinned" the same
        for page-locked host bytes (already counted in "host"): budget is
        memory.pinned_budget, None when unset."""
        report = {tier.value: vars(self.usage(tier)) for tier in Tier}
        report["pinned"] = vars(TierUsage() if self.pinned is None else self.pinned.usage())
        return report

    def ledger(self, tier: Tier) -> "TierLedger":
        """One tier of this account as a Ledger: what the I/O layer is handed, so it needs
        no knowledge of tiers."""
        return TierLedger(self, tier)


class TierLedger:
    """A Ledger charging one tier of a MemoryAccount."""

    def __init__(self, account: MemoryAccount, tier: Tier):
        self.account, self.tier = account, tier

    def charge(self, nbytes: int, what: str) -> None:
        self.account.charge(self.tier, nbytes, what)

    def credit(self, nbytes: int) -> None:
        self.account.credit(self.tier, nbytes)

    def usage(self) -> TierUsage:
        return self.account.usage(self.tier)
