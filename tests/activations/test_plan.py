"""The activations' part of the plan on the simulated device (Note [activations in the
plan] in offload/activations/plan.py): a device budget that holds the state but not
the state and every activation trains, each block kept whole, checkpointed, or with
its inputs on the host as the budget allows, with plain PyTorch's values."""
import copy

import pytest
import torch

import offload
from offload.accounting import TierBudgetError
from tests.support.harness import engine_weights, lm_loss, make_config, run_reference
from tests.support.models import VOCAB, TinyGPT

LAYERS, SEQ = 8, 32


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    monkeypatch.setenv("OFFLOAD_SIM_SEED", "0")


def _model():
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, hidden=24, heads=3, layers=LAYERS, seq=64)


def _data(seqs, batch=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, VOCAB, (batch, s), generator=gen), torch.randint(0, VOCAB, (batch, s), generator=gen))]
            for s in seqs]


def _config(tmp_path, budget, *, param="auto", optim="auto", **checkpointing):
    return make_config(param, optim, tmp_path, extra={"memory": {"device_budget": budget},
                                                      "activation_checkpointing": checkpointing})


def _train(model, data, cfg):
    """Losses, final weights, each forward's plan report, and the device tier's peak."""
    losses, plans = [], []
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        for (x, y), in data:
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            plans.append(engine.activation_report()["plan"])
        return torch.stack(losses), engine_weights(engine), plans, engine.memory_report()["device"]


def _assert_like_torch(model, data, losses, weights):
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_state_that_fits_with_activations_that_do_not_trains_like_plain_torch(tmp_path, sim):
    model, data = _model(), _data([SEQ] * 4)
    budget = 2_500_000  # homes and state take about 1 MB of it; every block whole needs about 3 MB more
    with pytest.raises(TierBudgetError, match="device tier budget exceeded"):  # without the plan: refused
        _train(model, data, _config(tmp_path / "off", budget, auto=False))
    losses, weights, plans, device = _train(model, data, _config(tmp_path / "on", budget))
    _assert_like_torch(model, data, losses, weights)
    first, later = plans[0]["last"], plans[-1]["last"]
    assert first["measuring"] and first["checkpointed"] == LAYERS  # the first forward measures
    assert not later["measuring"] and later["whole"] + later["checkpointed"] == LAYERS
    assert 0 < later["whole"] < LAYERS, plans[-1]["said"]
    assert "keep their activations" in plans[-1]["said"] and "memory.device_budget 2500000" in plans[-1]["why"]
    assert device["peak"] <= budget
    # Checkpointing changes no value: the same run with room for everything, bit for bit.
    roomy_losses, roomy_weights, roomy_plans, _ = _train(model, data, _config(tmp_path / "roomy", 50_000_000))
    assert roomy_plans[-1]["last"]["whole"] == LAYERS
    torch.testing.assert_close(losses, roomy_losses, rtol=0, atol=0)
    for name, value in weights.items():
        torch.testing.assert_close(value, roomy_weights[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_a_longer_sequence_is_measured_at_its_first_forward_then_planned(tmp_path, sim):
    model, data = _model(), _data([16, 16, SEQ, SEQ, 16])
    losses, weights, plans, device = _train(model, data, _config(tmp_path, 2_000_000))
    _assert_like_torch(model, data, losses, weights)
    measuring = [p["last"]["measuring"] for p in plans]
    assert measuring == [True, False, True, False, False]  # a shorter one is planned from the longer's figures
    assert plans[3]["last"]["checkpointed"] > plans[1]["last"]["checkpointed"]
    assert device["peak"] <= 2_000_000


def test_checkpoint_inputs_go_to_the_host_where_the_device_cannot_hold_them(tmp_path, sim):
    model, data = _model(), _data([SEQ] * 3)
    # Homes and state on the host: the device holds the gathered working set and activations.
    # The budget holds one block recomputed and the head, not every block's inputs beside them.
    cfg = _config(tmp_path, 550_000, param="cpu", optim="cpu")
    losses, weights, plans, device = _train(model, data, cfg)
    _assert_like_torch(model, data, losses, weights)
    assert plans[-1]["last"]["inputs_on_host"] > 0, plans[-1]["said"]
    assert "with their inputs on the host" in plans[-1]["said"]
    assert device["peak"] <= 550_000


def test_a_budget_even_the_plan_cannot_meet_names_what_to_change_and_keeps_the_weights(tmp_path, sim):
    model, data = _model(), _data([SEQ])
    cfg = _config(tmp_path, 500_000, param="cpu", optim="cpu")  # one block recomputed does not fit
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        before = engine_weights(engine)
        with pytest.raises(TierBudgetError, match=r"activation plan .* put less there"):
            (x, y), = data[0]
            engine.backward(lm_loss(engine(x), y))
        after = engine_weights(engine)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)


def test_no_plan_without_a_device_budget_or_where_the_config_names_the_modules(tmp_path, sim, monkeypatch):
    model, data = _model(), _data([SEQ])
    _, _, plans, _ = _train(model, data, _config(tmp_path / "a", None))
    assert plans == [None]  # the sim says no free memory: nothing to plan within
    _, _, plans, _ = _train(model, data, _config(tmp_path / "b", 50_000_000, modules=["Block"]))
    assert plans == [None]
    monkeypatch.setenv("OFFLOAD_DEVICE", "cpu")  # the device is the host: its budget is the host's
    _, _, plans, _ = _train(model, data, _config(tmp_path / "c", 50_000_000))
    assert plans == [None]


def test_a_model_that_checkpoints_its_own_blocks_is_left_to_do_so(tmp_path, sim):
    """Hugging Face's gradient_checkpointing_enable() sets is_gradient_checkpointing: its
    blocks are already checkpointed, so the plan does not checkpoint them a second time."""
    model, data = _model(), _data([SEQ] * 2)
    model.is_gradient_checkpointing = True  # what the flag reads; the model itself runs as it is
    losses, weights, plans, _ = _train(model, data, _config(tmp_path, 50_000_000))
    assert [p["last"] for p in plans] == [None, None]
    _assert_like_torch(model, data, losses, weights)
