"""estimate and initialize reserve the same bytes for what the update of NVMe
optimizer state keeps in flight (offload.placement.nvme_state_buffers): compared
to the byte, for parameters and state on cpu and nvme, fp32 and bf16. (An auto
plan is not compared: estimate's plan and initialize's can still put different
parameters' state on NVMe for the same budget.)
On a model whose every layer is one parameter, so the estimate's largest layer
is initialize's largest partition."""
import pytest
import torch

import offload
from offload.engine import budgets
from offload.placement import nvme_state_buffers
from offload.tiers import Tier

from tests.support.harness import make_config

IN_FLIGHT = set(nvme_state_buffers(1, 2, True))  # the terms' names


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(40, 16, bias=False))


def _initialize_reserves(config) -> dict[str, int]:
    seen = {}
    check = budgets.check_needs

    def spy(need, cfg):
        seen.update(need[Tier.HOST])
        return check(need, cfg)

    budgets.check_needs = spy
    try:
        with offload.initialize(_model(), config):
            pass
    finally:
        budgets.check_needs = check
    return {k: v for k, v in seen.items() if k in IN_FLIGHT}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")])
def test_estimate_and_initialize_reserve_the_same_bytes_in_flight(tmp_path, precision, param, optim):
    config = make_config(param, optim, tmp_path, precision=precision)
    model = _model()
    numel = [p.numel() for p in model.parameters()]
    est = offload.estimate(sum(numel), config=config, largest_layer_params=max(numel), persistent_params=0)
    estimated = {k: v for k, v in est.breakdown["host"].items() if k in IN_FLIGHT}
    reserved = _initialize_reserves(config)
    assert estimated == reserved
    if optim == "cpu":
        assert not reserved  # no state on NVMe: nothing in flight, in either
    else:
        assert reserved  # the comparison is of something
