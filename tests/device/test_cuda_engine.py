"""The engine on a real GPU, under PyTorch's CUDA stream sanitizer.

    TORCH_CUDA_SANITIZER=1 python -m pytest -m cuda tests/device/test_cuda_engine.py

Skipped without CUDA, or without TORCH_CUDA_SANITIZER=1 (a run that does not
check stream order proves less than the sim tests already do). No GPU has
been lent to this project: these have never run (README, "GPU readiness").
What they check is what tests/engine/test_sim_engine.py checks on the sim:
training equals plain PyTorch on the same GPU, and no pinned allocation after
the first step; the sanitizer raises on any unsynchronized access between
the compute, h2d and d2h streams (Note [copy streams])."""
import copy
import os

import pytest
import torch

import offload
from tests.engine.harness import batches, build, lm_loss, make_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)"),
    pytest.mark.skipif(os.environ.get("TORCH_CUDA_SANITIZER") != "1",
                       reason="run with TORCH_CUDA_SANITIZER=1 (PyTorch's CUDA stream sanitizer)"),
]

STEPS = 4


def _train(step_fn, data):
    losses = []
    for per_rank in data:
        x, y = (t.cuda() for t in per_rank[0])
        losses.append(step_fn(x, y))
    return torch.stack(losses)


def _reference(model, data, *, lr=1e-2, weight_decay=0.01, dtype=torch.float32):
    model = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def step(x, y):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().float().cpu()
    return model, _train(step, data)


@pytest.mark.parametrize("param,optim,precision", [("cpu", "cpu", "fp32"), ("nvme", "cpu", "fp32"),
                                                   ("cpu", "nvme", "bf16"), ("none", "cpu", "fp32")])
def test_training_on_cuda_matches_pytorch_on_the_same_gpu(tmp_path, monkeypatch, param, optim, precision):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cuda")
    model, data = build("tiny_gpt"), batches(STEPS)
    ref_model, ref_losses = _reference(model, data, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    with offload.initialize(copy.deepcopy(model), make_config(param, optim, tmp_path, precision=precision)) as engine:
        assert engine.device_layer.name == "cuda" and engine.device.type == "cuda"

        def step(x, y):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.detach().float().cpu()
        losses = _train(step, data)
        weights = engine.full_state_dict(master=True)
    tol = {"rtol": 2e-2, "atol": 2e-2} if precision == "bf16" else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(losses, ref_losses, **tol)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name].cpu().float(), p.detach().cpu(), **tol)


def test_no_pinned_allocation_after_the_first_step_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cuda")
    data = batches(STEPS)
    with offload.initialize(build("tiny_gpt"), make_config("nvme", "cpu", tmp_path)) as engine:
        def step(x, y):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.detach().float().cpu()
        _train(step, data[:1])
        after_first = engine.device_layer.counters.pinned_allocations
        _train(step, data[1:])
        assert engine.device_layer.counters.pinned_allocations == after_first > 0
