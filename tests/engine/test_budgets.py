"""Memory budgets: what initialize accepts, the engine holds (issue 16).

initialize's check reserves what the engine itself will hold at once: the
parameters one module gathers together or the prefetcher's live limit, plus
its one read ahead (Note [prefetch within the device budget] in
offload/partition/prefetch.py), idle gathered buffers kept for reuse, and the
optimizer's buffers in flight. Reads ahead and reuse are optional holdings:
the prefetcher starts a read only where the budget has room and gives what
it holds back when a needed charge would pass the budget. Saved activations
depend on the inputs, which initialize does not see: they get what the
budget leaves, and a step that needs more raises naming them and that figure.
"""
import copy
import re

import pytest
import torch

import offload
from offload.accounting import MemoryAccount, TierBudgetError
from offload.tiers import Tier
from tests.support.harness import batches, build, lm_loss, make_config, run_reference

STEPS = 3


def _config(tmp_path, budget, *, param="nvme", optim="cpu", prefetch=True):
    cfg = make_config(param, optim, tmp_path, extra={"memory": {"device_budget": budget}})
    if not prefetch:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    return cfg


def _threshold(tmp_path, **kw) -> int:
    """The least device budget initialize accepts, read from its refusal of 1 byte."""
    with pytest.raises(MemoryError) as refused:
        offload.initialize(build("tiny_gpt"), _config(tmp_path, 1, **kw))
    return int(re.search(r"needs at least (\d+) bytes on the device tier", str(refused.value)).group(1))


def _train(tmp_path, budget, data, **kw):
    """(losses, weights, device peak, prefetch stats), or the TierBudgetError a step raised."""
    engine = offload.initialize(build("tiny_gpt"), _config(tmp_path, budget, **kw))
    try:
        losses = []
        for per_rank in data:
            x, y = per_rank[0]
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        weights = engine.full_state_dict(master=True)
        return torch.stack(losses), weights, engine.account.usage(Tier.DEVICE).peak, engine.manager.prefetch.stats
    except TierBudgetError as err:
        return err
    finally:
        engine.close()


@pytest.mark.parametrize("optim", ["cpu", pytest.param("nvme", marks=pytest.mark.slow)])
def test_budget_sweep_with_prefetch(tmp_path, optim):
    """From the budget just refused to a generous one: refusals name the numbers;
    every accepted budget holds the engine's own working set, and trains equal to
    plain PyTorch wherever the saved activations fit in what it leaves; where they
    do not, the first forward says so, with the figures. Prefetching on never
    needs a larger budget than prefetching off."""
    data = batches(STEPS)
    ref_model, ref_losses = run_reference(build("tiny_gpt"), data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    need = _threshold(tmp_path, optim=optim)
    with pytest.raises(MemoryError, match=rf"needs at least {need} bytes on the device tier .*working set.* "
                                          rf"memory\.device_budget is {need - 1}; raise memory\.device_budget "
                                          rf"to at least {need}, or lower zero_optimization\."
                                          rf"stage3_max_live_parameters"):
        offload.initialize(build("tiny_gpt"), _config(tmp_path, need - 1, optim=optim))

    assert _threshold(tmp_path, optim=optim, prefetch=False) <= need
    first_trained = {}
    for prefetch in (True, False):
        step = 8192
        for budget in range(need, 40 * need, step):  # one grid for both (need: prefetch on's threshold, the higher)
            outcome = _train(tmp_path, budget, data, optim=optim, prefetch=prefetch)
            if isinstance(outcome, TierBudgetError):
                # The saved activations took more than initialize left them (a gather or an activation then
                # finds no room), and the message says how much initialize reserved.
                assert re.search(r"device tier budget exceeded allocating \d+ bytes for .*initialize reserved "
                                 rf"\d+ of memory\.device_budget {budget} bytes .*leaving \d+ for saved "
                                 r"activations", str(outcome)), outcome
                assert prefetch not in first_trained
                continue
            losses, weights, peak, stats = outcome
            first_trained.setdefault(prefetch, budget)
            assert peak <= budget
            torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=0)
            for name, p in ref_model.named_parameters():
                torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            if budget - first_trained[prefetch] >= 2 * step:
                if prefetch:
                    assert stats["prefetched"] > 0 and stats["hits"] > 0
                break
        assert prefetch in first_trained, f"prefetch={prefetch}: nothing trained up to {40 * need} bytes"
    # Same sweep points: reads ahead never made a budget fail that trains without them.
    assert first_trained[True] <= first_trained[False]


def test_prefetch_defers_reads_the_budget_has_no_room_for(tmp_path):
    """A budget that holds the working set the step needs but not the prefetcher's depth: reads ahead
    wait (stats['deferred_for_budget']), the device tier never passes the budget, and the result is exact."""
    data = batches(STEPS)
    ref_model, ref_losses = run_reference(build("tiny_gpt"), data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    generous = _train(tmp_path, None, data)
    budget = generous[2] - 6000  # less than the unbudgeted peak: something had to give
    losses, weights, peak, stats = _train(tmp_path, budget, data)
    assert peak <= budget
    assert stats["deferred_for_budget"] > 0
    torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0)


def test_a_charge_past_the_budget_reclaims_optional_holdings_first():
    account = MemoryAccount({Tier.DEVICE: 100})
    account.charge(Tier.DEVICE, 80, "a read ahead")
    asked = []

    def reclaim(nbytes):
        asked.append(nbytes)
        account.credit(Tier.DEVICE, 80)

    account.add_reclaimer(Tier.DEVICE, reclaim)
    assert not account.fits(Tier.DEVICE, 30)
    account.charge(Tier.DEVICE, 30, "a gather the step needs")
    assert asked == [10] and account.usage(Tier.DEVICE).now == 30
    account.remove_reclaimer(Tier.DEVICE)
    account.budget_notes[Tier.DEVICE] = "initialize reserved 30"
    with pytest.raises(TierBudgetError, match=r"allocating 80 bytes for more: 30 of 100 bytes already held; "
                                              r"initialize reserved 30"):
        account.charge(Tier.DEVICE, 80, "more")
