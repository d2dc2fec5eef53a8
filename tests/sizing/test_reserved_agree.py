"""estimate and initialize agree to the byte on what initialize checks against the
budgets, term by term on the device and host tiers: homes and state, gradients,
swap and parameter staging buffers, the gathered working set, the NVMe state in
flight. Both compute it with one function (offload/engine/reserve.py), and under
"auto" both settle the plan with one loop, so the plans agree too. For parameters
and state on cpu, nvme and auto (with budgets that spill part of the model to
NVMe), fp32 and bf16, beside a device with memory of its own (the sim: what the
estimate assumes).

On a model whose every layer is one parameter, so the layers the estimate counts
are initialize's parameters, and what one module gathers is one parameter."""
import pytest
import torch

import offload
from offload.engine import budgets
from offload.tiers import Tier

from tests.support.harness import make_config

SIZES = ((64, 96), (96, 64)) * 8  # Linear(in, out): each layer one parameter, all of one size


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(i, o, bias=False) for i, o in SIZES))


def _initialize_needs(config) -> tuple[dict, object]:
    seen = {}
    check = budgets.check_needs

    def spy(need, cfg, pg=None):
        seen.update({t.value: dict(parts) for t, parts in need.items()})
        return check(need, cfg, pg)

    budgets.check_needs = spy
    try:
        with offload.initialize(_model(), config) as engine:
            plan = engine.placement()
    finally:
        budgets.check_needs = check
    return seen, plan


def _config(side, tmp_path, precision, host_budget):
    cfg = make_config(side, side, tmp_path, precision=precision)
    if side == "auto":
        for key in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][key]["nvme_path"] = str(tmp_path)
    cfg["memory"] = {"host_budget": host_budget, "device_budget": 96 << 10}
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("side,host_budget", [("cpu", 1 << 40), ("nvme", 1 << 40), ("auto", 1 << 40),
                                              ("auto", 1_200_000)])
def test_estimate_and_initialize_check_the_same_bytes_against_the_budgets(tmp_path, monkeypatch, precision, side,
                                                                          host_budget):
    """auto at 1.2 MB: a host budget short of the whole model's needs, so both plans put
    part of it on NVMe (and a replan may follow: the engine's buffers grow with it)."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    numel = [i * o for i, o in SIZES]
    config = _config(side, tmp_path, precision, host_budget)
    est = offload.estimate(sum(numel), config=config, largest_layer_params=max(numel), persistent_params=0)
    needs, plan = _initialize_needs(config)
    assert set(needs) == {"device", "host"}
    assert est.needs == needs
    if side == "auto":
        assert [(s.home, s.state) for s in est.placement.shards] == [(s.home, s.state) for s in plan.shards]
        assert est.breakdown["host"] == needs["host"]  # the estimate's own figures are initialize's
        spilled = [s for s in plan.shards if Tier.NVME in (s.home, s.state)]
        assert bool(spilled) is (host_budget < 1 << 40), plan.format()
        assert sum(needs["host"].values()) <= host_budget
    if side == "nvme":
        assert "optimizer state buffers in flight" in needs["host"]  # the comparison is of something
        assert "swap staging buffers" in needs["host"]
