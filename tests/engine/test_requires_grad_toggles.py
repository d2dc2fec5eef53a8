"""requires_grad changed between micro-steps after initialize, as plain PyTorch allows:
DeepSpeed's own ZeRO test TestZeroUnbalancedGradients (tests/unit/v1/zero/test_zero.py)
freezes alternate halves of the parameters before each micro-step, with gradient
accumulation. Trained equal to plain PyTorch doing the same, bit for bit (with clipping, to
fp32 rounding)."""
import copy

import pytest
import torch

import offload
from tests.support.harness import batches, build, engine_weights, lm_loss, make_config, run_reference_mixed, train_engine


def _halves(model, i: int) -> None:
    """Before micro-step i: one half of the parameters trains, the other is frozen, in turn."""
    params = list(model.parameters())
    half = len(params) // 2
    for j, p in enumerate(params):
        p.requires_grad_((j < half) == (i % 2 == 0))


def _plain(model, data, gas, clip):
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for i, ((x, y),) in enumerate(data):
        _halves(ref, i)
        (lm_loss(ref(x), y) / gas).backward()
        if (i + 1) % gas == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return {name: p.detach().clone() for name, p in ref.named_parameters()}


@pytest.mark.parametrize("layer", ["cpu", "sim"])
@pytest.mark.parametrize("place", ["cpu", "nvme", "auto"])
@pytest.mark.parametrize("precision,gas,clip", [("fp32", 1, 0.0), ("fp32", 2, 0.0), ("fp32", 2, 0.05),
                                                ("bf16", 2, 0.0)])
def test_alternate_halves_frozen_per_micro_step_train_as_plain_torch(tmp_path, monkeypatch, layer, place,
                                                                     precision, gas, clip):
    monkeypatch.setenv("OFFLOAD_DEVICE", layer)
    model = build("tiny_gpt")
    data = batches(6, seed=5)
    if precision == "bf16":  # bf16 computes, fp32 masters step (the engine's recipe)
        ref, _ = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=gas, lr=1e-2, weight_decay=0.01,
                                     before_step=_halves)
        want = {name: p.detach().clone() for name, p in ref.named_parameters()}
    else:
        want = _plain(model, data, gas, clip)
    model = copy.deepcopy(model)
    cfg = make_config(place, place, tmp_path, gas=gas, clip=clip, persistence=100, precision=precision)
    if place == "auto":
        for key in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][key]["nvme_path"] = str(tmp_path)
    with offload.initialize(model, cfg) as engine:
        for i, ((x, y),) in enumerate(data):
            _halves(model, i)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        got = engine_weights(engine)
    # Bit for bit; with clipping, to fp32 rounding: the engine sums the global norm in its own
    # order (Note [global gradient norm]), as tests/engine/test_parity.py's clipping case says.
    tolerance = {} if clip else {"rtol": 0, "atol": 0}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tolerance, msg=lambda m: f"{name}: {m}")


def _unfreeze_plain(model, data, frozen, at):
    """Plain PyTorch: `frozen` start frozen (the optimizer lists every parameter, as the engine's
    does) and train from step `at`."""
    ref = copy.deepcopy(model)
    for name, p in ref.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for i, ((x, y),) in enumerate(data):
        if i == at:
            for name in frozen:
                ref.get_parameter(name).requires_grad_(True)
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in ref.named_parameters()}


FROZEN_AT_START = ("wte.weight", "wpe", "blocks.0.qkv.weight", "blocks.0.proj.bias", "blocks.0.ln1.weight")


@pytest.mark.parametrize("layer", ["cpu", "sim"])
@pytest.mark.parametrize("place", ["cpu", "nvme", "auto", "none"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameters_frozen_at_initialize_train_from_the_step_they_are_unfrozen(tmp_path, monkeypatch, layer, place,
                                                                               precision):
    monkeypatch.setenv("OFFLOAD_DEVICE", layer)
    model = build("tiny_gpt")
    data = batches(6, seed=7)
    if precision == "bf16":
        # A parameter frozen in bf16 is its bf16 home alone: unfrozen, its master starts from that
        # value (Note [unfreezing]). The reference starts those from the same values.
        with torch.no_grad():
            for name in FROZEN_AT_START:
                model.get_parameter(name).copy_(model.get_parameter(name).bfloat16().float())

        def before(m, i):
            for name, p in m.named_parameters():
                if i == 0:
                    p.requires_grad_(name not in FROZEN_AT_START)
                if i == 3 and name in FROZEN_AT_START:
                    p.requires_grad_(True)
        ref, _ = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=1, lr=1e-2, weight_decay=0.01,
                                     before_step=before)
        want = {name: p.detach().clone() for name, p in ref.named_parameters()}
    else:
        want = _unfreeze_plain(model, data, FROZEN_AT_START, 3)
    model = copy.deepcopy(model)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN_AT_START)
    cfg = make_config(place, place, tmp_path, persistence=100, precision=precision)
    if place == "auto":
        for key in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][key]["nvme_path"] = str(tmp_path)
    with offload.initialize(model, cfg) as engine:
        held_before = {t: u["now"] for t, u in engine.memory_report().items() if t in ("device", "host", "nvme")}
        for i, ((x, y),) in enumerate(data):
            if i == 3:
                for name in FROZEN_AT_START:
                    model.get_parameter(name).requires_grad_(True)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        got = engine_weights(engine)
        plan = {s.name: s.state for s in engine.placement().shards}
        held_after = {t: u["now"] for t, u in engine.memory_report().items() if t in ("device", "host", "nvme")}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert all(plan[n] is not None for n in FROZEN_AT_START)  # each has its optimizer state now
    assert sum(held_after.values()) > sum(held_before.values())


def test_an_unfreeze_the_host_budget_cannot_hold_is_refused_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cpu")
    model = build("tiny_gpt")
    for name, p in model.named_parameters():
        p.requires_grad_(name != "wte.weight")
    data = batches(3, seed=7)

    def run(budget):
        cfg = make_config("cpu", "cpu", tmp_path, extra={"memory": {"host_budget": budget}} if budget else None)
        return offload.initialize(copy.deepcopy(model), cfg)

    with run(None) as engine:  # what this engine holds at its peak, frozen as built
        train_engine(engine, data[:1])
        peak = engine.memory_report()["host"]["peak"]
    with run(peak + 1024) as engine:  # room for the step, not for wte's 37 x 24 x 16 bytes more
        train_engine(engine, data[:1])
        before = engine_weights(engine)
        engine.module.wte.weight.requires_grad_(True)
        (x, y), = data[1]
        with pytest.raises(MemoryError, match=r"wte[.]weight.*host tier.*nothing was changed"):
            engine(x)
        assert engine.placement().shards[1].state is None and not engine.shards[1].trainable
        torch.testing.assert_close(engine_weights(engine)["wte.weight"], before["wte.weight"], rtol=0, atol=0)
        engine.module.wte.weight.requires_grad_(False)  # training goes on, frozen as before
        train_engine(engine, data[1:])
        assert torch.equal(engine_weights(engine)["wte.weight"], before["wte.weight"])
