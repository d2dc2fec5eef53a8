"""Memory per tier: the engine's own accounting, the budgets it promises, and
the process RSS the OS reports."""
import pytest
import torch
from torch import nn

import offload
from tests.engine.harness import make_config

MiB = 1 << 20


class Wide(nn.Module):
    """Eight 1024x1024 layers (8.4M params, 32 MiB fp32), tiny activations."""

    def __init__(self, layers=8, width=1024):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _train(engine, steps=3):
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 1024)))
        engine.step()


def test_device_tier_holds_one_layer_at_a_time(tmp_path):
    """With parameters on NVMe, the device tier's peak is the largest layer's
    weight and bias (the manager gathers one module's parameters at a time);
    with them in host memory on a CPU-only host, gathering copies nothing
    (Note [zero-copy gather]).
    Saved activations are on the device tier too (Note [activation bytes]):
    the input and each layer's tanh output, one 2 x 1024 fp32 storage each
    (the next layer's saved input is the same storage). While the last
    layer is gathered, 8 of those 9 are saved; the most at once is all 9."""
    torch.manual_seed(0)
    layer = (1024 * 1024 + 1024) * 4
    act = 2 * 1024 * 4
    expected = {"nvme": layer + 8 * act, "cpu": layer + 8 * act if torch.cuda.is_available() else 9 * act}
    for param, optim in (("cpu", "cpu"), ("nvme", "nvme")):
        cfg = make_config(param, optim, tmp_path / param)
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        engine = offload.initialize(Wide(), cfg)
        _train(engine)
        report = engine.memory_report()
        engine.close()
        assert report["device"]["peak"] == expected[param], (param, report)
        assert report["device"]["now"] == 0


@pytest.mark.parametrize("live_layers", [None, 2])
def test_prefetch_stays_within_the_live_limit(tmp_path, live_layers):
    """Parameters gathered, read ahead or kept for reuse stay within
    stage3_max_live_parameters (by default four of the largest parameters,
    Note [prefetch order]); the one read always allowed ahead can add a layer."""
    torch.manual_seed(0)
    layer = (1024 * 1024 + 1024) * 4
    act = 2 * 1024 * 4
    cfg = make_config("nvme", "nvme", tmp_path)
    if live_layers is not None:
        cfg["zero_optimization"]["stage3_max_live_parameters"] = live_layers * (1024 * 1024 + 1024)
    engine = offload.initialize(Wide(), cfg)
    _train(engine, steps=4)
    report = engine.memory_report()
    stats = engine.manager.prefetch.stats
    engine.close()
    assert stats["hits"] > 0
    live = 4 * 1024 * 1024 * 4 if live_layers is None else live_layers * layer
    assert layer + 8 * act < report["device"]["peak"] <= live + layer + 9 * act, report
    assert report["device"]["now"] == 0


def test_budgets_are_enforced_at_initialize(tmp_path):
    cfg = make_config("cpu", "cpu", tmp_path, extra={"memory": {"host_budget": "8MiB"}})
    with pytest.raises(MemoryError, match=r"host tier budget exceeded: .*needs at least \d+ bytes.*8388608"):
        offload.initialize(Wide(layers=2), cfg)
