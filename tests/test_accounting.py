"""One ledger shape (offload/accounting.py): a tier of the account and the engine's
page-locked bytes both charge, credit and answer usage() alike, and both refuse past
their budget with TierBudgetError, before counting anything."""
import pytest

from offload.accounting import Ledger, MemoryAccount, TierBudgetError, TierUsage
from offload.aio.buffer_pool import PinnedLedger
from offload.tiers import Tier


def _ledgers():
    account = MemoryAccount({Tier.HOST: 10_000})
    host = account.ledger(Tier.HOST)
    pinned = account.pinned = PinnedLedger(host, budget=6_000)
    return account, host, pinned


@pytest.mark.parametrize("which", ["host", "pinned"])
def test_each_ledger_charges_credits_and_reports_alike(which):
    account, host, pinned = _ledgers()
    ledger: Ledger = host if which == "host" else pinned
    ledger.charge(4_000, "a")
    ledger.charge(1_000, "b")
    ledger.credit(3_000)
    assert ledger.usage() == TierUsage(now=2_000, peak=5_000, budget=10_000 if which == "host" else 6_000)
    with pytest.raises(TierBudgetError, match="budget exceeded allocating 9000 .*for c"):
        ledger.charge(9_000, "c")
    assert ledger.usage().now == 2_000  # refused before anything was counted
    assert account.usage(Tier.HOST).now == 2_000  # pinned bytes are host bytes


def test_the_report_has_each_ledgers_usage():
    account, host, pinned = _ledgers()
    pinned.charge(1_000, "ring")
    host.charge(500, "home")
    report = account.report()
    assert report["host"] == {"now": 1_500, "peak": 1_500, "budget": 10_000}
    assert report["pinned"] == {"now": 1_000, "peak": 1_000, "budget": 6_000}
    account.reset_peak()
    pinned.credit(1_000)
    assert account.report()["pinned"] == {"now": 0, "peak": 1_000, "budget": 6_000}
