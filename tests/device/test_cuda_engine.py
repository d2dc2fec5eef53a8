"""The engine on a real GPU, under PyTorch's CUDA stream sanitizer.

    TORCH_CUDA_SANITIZER=1 python -m pytest -m cuda tests/device/test_cuda_engine.py

Skipped without CUDA, or without TORCH_CUDA_SANITIZER=1 (a run that does not
check stream order proves less than the sim tests already do). The device-
agnostic subset (`-m any_device`, Note [the device a test runs on] in
tests/conftest.py) runs on the GPU beside these with OFFLOAD_TEST_DEVICE=cuda;
benchmarks/gpu/check.sh runs both.
What they check is what tests/engine/test_sim_engine.py checks on the sim:
training equals plain PyTorch on the same GPU, and no pinned allocation after
the first step; the sanitizer raises on any unsynchronized access between
the compute, h2d and d2h streams (Note [copy streams])."""
import copy
import os

import pytest
import torch

import offload
from tests.support.harness import batches, build, lm_loss, make_config, run_reference_mixed

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


def _reference(model, data, *, lr=1e-2, weight_decay=0.01, dtype=torch.float32, state_on_device=False):
    """Plain PyTorch on the GPU, by the engine's recipe: fp32 AdamW; in bf16, a bf16
    copy computes on the GPU and fp32 masters step on the host (harness's
    run_reference_mixed; torch.autocast is another recipe: it keeps fp32 weights
    and casts per op, so the two differ by more than rounding)."""
    if dtype != torch.float32:
        master, losses = run_reference_mixed(model, data, dtype=dtype, gas=1, lr=lr, weight_decay=weight_decay,
                                             state_on_device=state_on_device)
        return master, losses[:, 0]
    model = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def step(x, y):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().float().cpu()
    return model, _train(step, data)


def _engine_step(engine):
    """One training step through the engine, returning its loss on the host."""
    def step(x, y):
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach().float().cpu()
    return step


@pytest.mark.parametrize("param,optim,precision", [("cpu", "cpu", "fp32"), ("nvme", "cpu", "fp32"),
                                                   ("cpu", "nvme", "bf16"), ("none", "cpu", "fp32")])
def test_training_on_cuda_matches_pytorch_on_the_same_gpu(tmp_path, monkeypatch, param, optim, precision):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cuda")
    monkeypatch.setenv("OFFLOAD_TEST_DEVICE", "cuda")  # the harness's reference on the GPU too
    model, data = build("tiny_gpt"), batches(STEPS)
    ref_model, ref_losses = _reference(model, data, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    with offload.initialize(copy.deepcopy(model), make_config(param, optim, tmp_path, precision=precision)) as engine:
        assert engine.device_layer.name == "cuda" and engine.device.type == "cuda"

        losses = _train(_engine_step(engine), data)
        weights = engine.full_state_dict(master=True)
    tol = {"rtol": 1e-4, "atol": 1e-5}  # the same recipe in bf16 too: fp32 rounding apart
    torch.testing.assert_close(losses, ref_losses, **tol)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name].cpu().float(), p.detach().cpu().float(), **tol)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_auto_placement_with_optimizer_state_on_the_gpu_matches_pytorch(tmp_path, monkeypatch, precision):
    """Note [automatic placement]: every home and the state of some on the GPU (updated by
    torch's fused Adam there, gradients never leaving it), the rest updated on the host."""
    from offload.tiers import Tier

    monkeypatch.setenv("OFFLOAD_DEVICE", "cuda")
    monkeypatch.setenv("OFFLOAD_TEST_DEVICE", "cuda")
    model, data = build("tiny_gpt"), batches(STEPS)
    cfg = make_config("cpu", "cpu", tmp_path, precision=precision)
    for key in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][key] = {"device": "auto"}
    numel = sum(p.numel() for p in model.parameters())
    itemsize = 2 if precision == "bf16" else 4
    # Half of it for homes and state: every home, and the state of about half the elements.
    cfg["memory"] = {"device_budget": 2 * (numel * itemsize + 8 * numel)}
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        plan = engine.placement()
        assert all(s.home is Tier.DEVICE for s in plan.shards), plan.format()
        assert plan.state_tiers == {Tier.DEVICE, Tier.HOST}, plan.format()

        losses = _train(_engine_step(engine), data)
        weights = engine.full_state_dict(master=True)
    # In bf16 each master steps where the engine's does (run_reference_mixed): a
    # master an ulp apart can round to another bf16 value, and that grows.
    ref_model, ref_losses = _reference(model, data, dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                                       state_on_device={s.name for s in plan.shards if s.state is Tier.DEVICE})
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(losses, ref_losses, **tol)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name].cpu().float(), p.detach().cpu().float(), **tol)


def test_no_pinned_allocation_after_the_first_step_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_DEVICE", "cuda")
    data = batches(STEPS)
    with offload.initialize(build("tiny_gpt"), make_config("nvme", "cpu", tmp_path)) as engine:
        step = _engine_step(engine)
        _train(step, data[:1])
        after_first = engine.device_layer.counters.pinned_allocations
        _train(step, data[1:])
        assert engine.device_layer.counters.pinned_allocations == after_first > 0


def test_copy_timing_counts_each_way_of_the_bus_on_cuda(tmp_path, monkeypatch):
    """What the benchmark's bus figures stand on: a cpu/cpu step moves every parameter
    up (its gather) and every gradient down, counted each way and timed by events."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "cuda")
    data = batches(STEPS)
    model = build("tiny_gpt")
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    with offload.initialize(model, make_config("cpu", "cpu", tmp_path)) as engine:
        step = _engine_step(engine)
        layer = engine.device_layer
        _train(step, data[:1])
        layer.time_copies()
        up, down = layer.counters.bytes_to_device, layer.counters.bytes_to_host
        _train(step, data[1:2])
        torch.cuda.synchronize()
        seconds = layer.copy_seconds()
        assert layer.counters.bytes_to_device - up >= param_bytes
        assert layer.counters.bytes_to_host - down >= param_bytes
        assert seconds["up"] > 0 and seconds["down"] > 0
        assert layer.copy_seconds() == {"up": 0.0, "down": 0.0}
