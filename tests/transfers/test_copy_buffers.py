"""The copy streams' own host buffers beside a device with memory of its own (the
sim): the gradient staging ring and the pinned upload buffers of device homes' new
values. initialize reserves exactly what they take (engine/budgets.py tier_needs), so
a host budget too small for them is refused before anything moves, not part way
through placing the parameters; and the ring is sized by the trainable parameters
(a frozen one has no gradient), so a LoRA does not pin four of its largest frozen
weight in fp32."""
import pytest
import torch

import offload
from offload.engine import budgets
from offload.transfers.device_copies import ring_bytes

from tests.support.harness import batches, build, lm_loss, make_config


def _needs(monkeypatch) -> dict:
    seen = {}
    check = budgets.check_needs

    def spy(need, cfg, pg=None):
        seen.update({t.value: dict(parts) for t, parts in need.items()})
        return check(need, cfg, pg)

    monkeypatch.setattr(budgets, "check_needs", spy)
    return seen


@pytest.mark.parametrize("frozen", [False, True])
def test_initialize_reserves_what_the_ring_and_the_uploads_take(tmp_path, monkeypatch, frozen):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    seen = _needs(monkeypatch)
    model = build("tiny_gpt")
    if frozen:  # a LoRA's shape: the big weights frozen, the small ones trained
        for p in model.parameters():
            p.requires_grad_(p.numel() < 1000)
    cfg = make_config("cpu", "cpu", tmp_path, persistence=100)  # small ones homed on the device
    with offload.initialize(model, cfg) as engine:
        ring = engine.manager.to_host.ring
        uploads = engine.shard_context.streams.uploads.allocated_bytes  # all made at initialize
        trainable = [s.part_numel for s in engine.shards if s.trainable]
        everything = [s.part_numel for s in engine.shards]
        x, y = batches(1, seed=3)[0][0]
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    host = seen["host"]
    assert host["gradient staging ring"] == ring.capacity == ring_bytes(4 * max(trainable))
    assert host["upload staging buffers"] == uploads > 0
    if frozen:
        assert ring.capacity < ring_bytes(4 * max(everything))  # not sized by a frozen weight


def test_a_host_budget_without_room_for_the_copy_buffers_is_refused_before_anything_moves(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    seen = _needs(monkeypatch)
    model = build("tiny_gpt")
    with offload.initialize(model, make_config("cpu", "cpu", tmp_path / "probe", persistence=100)):
        pass
    host = seen["host"]
    short = sum(host.values()) - host["gradient staging ring"] // 2
    cfg = make_config("cpu", "cpu", tmp_path / "short", persistence=100)
    cfg["memory"] = {"host_budget": short}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(offload.TierBudgetError, match="gradient staging ring") as raised:
        offload.initialize(model, cfg)
    assert "needs at least" in str(raised.value)  # the check before anything moves, with its numbers
    for name, p in model.named_parameters():  # nothing moved: the model is as it was
        assert type(p) is torch.nn.Parameter
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
