"""Writes between steps reach every parameter's home and its optimizer master, on both
sides of stage3_param_persistence_threshold (Note [writes to device homes] and Note
[reading a parameter outside the engine] in offload/partition/managed.py): training
after the write equals plain PyTorch doing the same, bit for bit."""
import copy

import pytest
import torch

import offload
from tests.support.harness import batches, build, engine_weights, lm_loss, make_config, run_reference_mixed

# 0: every parameter offloaded; 100: the norms and biases (24 elements) homed on the
# device, the matrices offloaded; 10**6: every parameter homed on the device.
THRESHOLDS = [0, 100, 10**6]


def _pretrained():
    return build("tiny_gpt", seed=11).state_dict()


def _edit(model, how: str, step: int) -> None:
    """What a user does between steps 2 and 3, to plain torch's model and ours alike."""
    if how == "in_place":
        with torch.no_grad():
            model.ln_f.weight.fill_(1.5)
            model.blocks[0].fc.bias.mul_(0.5)
            model.blocks[1].fc.weight.add_(0.01)
    elif how == "load_state_dict":
        model.load_state_dict(_pretrained())
    elif how == "data":
        for p in (model.ln_f.bias, model.blocks[0].fc.weight):
            p.data = p.detach() * 0.5


def _plain(model, data, how, precision):
    if precision == "bf16":  # bf16 computes, fp32 masters step; a write lands in both
        ref, _ = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=1, lr=1e-2, weight_decay=0.01,
                                     before_step=lambda m, i: i == 2 and _edit(m, how, i))
        return {name: p.detach().clone() for name, p in ref.named_parameters()}
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for i, ((x, y),) in enumerate(data):
        if i == 2:
            _edit(ref, how, i)
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in ref.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layer", ["cpu", "sim"])
@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("place", ["cpu", "nvme", "auto"])
@pytest.mark.parametrize("how", ["in_place", "load_state_dict", "data"])
def test_a_write_between_steps_trains_on_as_plain_torch_does(tmp_path, monkeypatch, layer, threshold, place, how,
                                                            precision):
    monkeypatch.setenv("OFFLOAD_DEVICE", layer)
    model = build("tiny_gpt")
    data = batches(5, seed=3)
    want = _plain(model, data, how, precision)
    model = copy.deepcopy(model)
    cfg = make_config(place, place, tmp_path / "nvme", persistence=threshold, precision=precision)
    if place == "auto":
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "nvme")
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    (tmp_path / "nvme").mkdir()
    with offload.initialize(model, cfg) as engine:
        homes = {s.home.value for s in engine.shards}
        if threshold == 10**6:
            assert homes == {"device"}
        for i, ((x, y),) in enumerate(data):
            if i == 2:
                _edit(model, how, i)
                # Seen at once, before any step: the home and the master hold the write.
                if how == "in_place":
                    assert torch.equal(model.ln_f.weight.detach().cpu(), torch.full((24,), 1.5))
                    assert torch.equal(engine_weights(engine)["ln_f.weight"], torch.full((24,), 1.5))
            lm_loss(model(x), y).backward()
            engine.step()
        got = engine_weights(engine)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        for name, p in model.named_parameters():  # what the model reads is what was trained
            torch.testing.assert_close(p.detach().cpu(), want[name].to(p.dtype), rtol=0, atol=0,
                                       msg=lambda m: f"{name}: {m}")


def test_a_device_home_refuses_a_value_of_another_shape_and_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cpu")
    model = build("tiny_gpt")
    with offload.initialize(model, make_config("cpu", "cpu", tmp_path, persistence=10**6)) as engine:
        before = engine_weights(engine)["ln_f.bias"]
        with pytest.raises(RuntimeError, match=r"ln_f\.bias.*homed on the device.*offload\.gathered"):
            model.ln_f.bias.data = torch.zeros(3)
        torch.testing.assert_close(engine_weights(engine)["ln_f.bias"], before, rtol=0, atol=0)
        assert model.ln_f.bias.shape == (24,)
