"""fp16 with dynamic loss scaling: an overflow skips the step and lowers the
scale; clean steps match plain PyTorch doing the same scaled mixed precision."""
import pytest
import torch

import offload
from tests.support.harness import batches, build, lm_loss, make_config


def _fp16_config(tmp_path, param, optim, **fp16):
    return make_config(param, optim, tmp_path, extra={"fp16": {"enabled": True, **fp16}})


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "nvme")])
def test_overflow_skips_the_step_and_lowers_the_scale(tmp_path, param, optim):
    # 2^40 times a loss of ~3.6 overflows fp16 (max 65504) in every gradient.
    cfg = _fp16_config(tmp_path, param, optim, initial_scale_power=40, hysteresis=2,
                       loss_scale_window=1000, min_loss_scale=1)
    data = batches(30, seed=11)
    with offload.initialize(build("shared_param"), cfg) as engine:
        before = engine.full_state_dict(master=True)
        scales = []
        for per_rank in data:
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            scales.append(engine.loss_scaler.scale)
        after = engine.full_state_dict(master=True)
        skipped, stepped = engine.skipped_steps, engine.global_steps
    # Hysteresis 2: the scale halves on every second overflow until gradients fit.
    assert scales[0] == 2.0 ** 40 and scales[1] == 2.0 ** 39
    # Then every overflow halves it (the first was tolerated), until the
    # gradients fit; the window (1000) is never reached, so it stays there.
    assert skipped >= 2 and stepped >= 1 and skipped + stepped == 30
    assert all(b <= a for a, b in zip(scales, scales[1:]))
    assert scales[-1] == 2.0 ** (40 - (skipped - 1))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # clean steps did update


def test_static_loss_scale_matches_scaled_pytorch(tmp_path):
    """Static scale 128: grads of loss*128 in fp16, unscaled in fp32, AdamW on
    fp32 masters; compared with plain PyTorch doing exactly that."""
    from offload.optim import CPUAdam

    torch.manual_seed(0)
    model = build("shared_param")
    data = batches(8, seed=12)
    master = __import__("copy").deepcopy(model)
    compute = __import__("copy").deepcopy(model).half()
    opt = CPUAdam(master.parameters(), lr=1e-2, weight_decay=0.01)
    for per_rank in data:
        x, y = per_rank[0]
        (lm_loss(compute(x), y) * 128.0).backward()
        for p32, p16 in zip(master.parameters(), compute.parameters()):
            p32.grad = p16.grad.float() / 128.0
            p16.grad = None
        opt.step()
        with torch.no_grad():
            for p32, p16 in zip(master.parameters(), compute.parameters()):
                p16.copy_(p32)
    cfg = _fp16_config(tmp_path, "cpu", "cpu", loss_scale=128.0)
    with offload.initialize(model, cfg) as engine:
        for per_rank in data:
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        weights = engine.full_state_dict(master=True)
        assert engine.skipped_steps == 0
    for name, p in master.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")
