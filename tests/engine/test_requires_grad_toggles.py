"""requires_grad changed between micro-steps after initialize, as plain PyTorch allows:
DeepSpeed's own ZeRO test TestZeroUnbalancedGradients (tests/unit/v1/zero/test_zero.py)
freezes alternate halves of the parameters before each micro-step, with gradient
accumulation. Trained equal to plain PyTorch doing the same, bit for bit (with clipping, to
fp32 rounding)."""
import copy

import pytest
import torch

import offload
from tests.engine.harness import batches, build, engine_weights, lm_loss, make_config, run_reference_mixed


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
