"""The engine trains exactly like plain PyTorch, for every placement of the
parameters and the optimizer state, on models built to break managers; on
the layer OFFLOAD_TEST_DEVICE names (Note [the device a test runs on])."""
import pytest
import torch

from tests.support.harness import (batches, build, make_config, on_test_device, run_engine, run_reference,
                                  run_reference_mixed)

pytestmark = [pytest.mark.any_device, pytest.mark.torch_release]

PLACEMENTS = [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme"), ("none", "cpu"),
              ("cpu", "nvme"), ("nvme", "cpu"), ("none", "nvme")]
# The fast part: each tier for both, and parameters on NVMe with state on the host.
SLOW_PLACEMENTS = {("none", "cpu"), ("cpu", "nvme"), ("none", "nvme")}
STEPS = 20


@pytest.mark.parametrize("model_name", ["tiny_gpt", "shared_param", "with_unused"])
@pytest.mark.parametrize("param,optim", [
    pytest.param(p, o, id=f"{p}-{o}", marks=pytest.mark.slow if (p, o) in SLOW_PLACEMENTS else ())
    for p, o in PLACEMENTS])
# The fast part accumulates gradients in the clipping test (gas 2).
@pytest.mark.parametrize("gas", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_fp32_matches_pytorch(tmp_path, model_name, param, optim, gas):
    model = build(model_name)
    data = batches(STEPS)
    ref_model, ref_losses = run_reference(model, data, gas=gas, clip=0.0, lr=1e-2, weight_decay=0.01)
    cfg = make_config(param, optim, tmp_path, gas=gas)
    weights, losses, _ = run_engine(model, data, cfg)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    expected = dict(ref_model.named_parameters())
    assert weights.keys() == expected.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name].detach(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_gradient_clipping_matches_pytorch(tmp_path, param, optim):
    model = build("tiny_gpt")
    data = batches(10, seed=3)
    ref_model, ref_losses = run_reference(model, data, gas=2, clip=0.05, lr=1e-2, weight_decay=0.0)
    cfg = make_config(param, optim, tmp_path, gas=2, clip=0.05, weight_decay=0.0)
    weights, losses, _ = run_engine(model, data, cfg)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach())


def test_hugging_faces_zero3_config_with_the_trainers_values_trains_like_plain_pytorch(tmp_path):
    """Hugging Face's published ZeRO-3 config, its autos given what the Trainer would
    (Note [Hugging Face autos]): WarmupLR, clipping at 1.0, cpu offload of both."""
    from offload.schedulers import build_scheduler
    from tests.config.hf_configs import filled

    cfg = filled({"train_micro_batch_size_per_gpu": 3, "optimizer.params.lr": 1e-2,
                  "scheduler.params.warmup_max_lr": 1e-2, "scheduler.params.warmup_num_steps": 3})
    model = build("tiny_gpt")
    data = batches(6, seed=8)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=1.0, lr=1e-2, weight_decay=0.0,
                                          scheduler_fn=lambda opt: build_scheduler(opt, cfg["scheduler"]))
    weights, losses, _ = run_engine(model, data, cfg)
    torch.testing.assert_close(losses, ref_losses[:, 0])  # the norm sums in another order than torch's
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach())


def test_scheduler_drives_the_engine_lr(tmp_path):
    from offload.schedulers import build_scheduler

    sched = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2,
                                                "warmup_num_steps": 4, "total_num_steps": 12,
                                                "warmup_type": "linear"}}
    model = build("shared_param")
    data = batches(12, seed=4)
    ref_model, ref_losses = run_reference(
        model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01,
        scheduler_fn=lambda opt: build_scheduler(opt, sched))
    cfg = make_config("cpu", "cpu", tmp_path, scheduler=sched)
    weights, losses, engine = run_engine(model, data, cfg)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach())
    assert engine.global_steps == 12


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme"),
                                         pytest.param("nvme", "cpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("gas", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_bf16_matches_pytorch_mixed_precision(tmp_path, param, optim, gas):
    """bf16 compute, fp32 masters and gradient accumulation: equal to plain
    PyTorch doing the same mixed precision, at fp32 tolerance."""
    model = build("tiny_gpt")
    data = batches(STEPS, seed=5)
    ref_model, ref_losses = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=gas,
                                                lr=1e-2, weight_decay=0.01, state_on_device=optim == "none")
    cfg = make_config(param, optim, tmp_path, precision="bf16", gas=gas)
    weights, losses, _ = run_engine(model, data, cfg)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_bf16_stays_close_to_fp32_training(tmp_path):
    """The stated bf16 tolerance against full fp32 PyTorch: over 20 steps,
    losses within 3e-2 and fp32 masters within 5e-2 (absolute)."""
    model = build("tiny_gpt")
    data = batches(STEPS, seed=5)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    weights, losses, _ = run_engine(model, data, make_config("cpu", "cpu", tmp_path, precision="bf16"))
    torch.testing.assert_close(losses, ref_losses[:, 0], rtol=0, atol=3e-2)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=5e-2)


def test_bf16_compute_copy_is_the_rounded_master(tmp_path):
    import offload

    model = build("tiny_gpt")
    cfg = make_config("cpu", "cpu", tmp_path, precision="bf16")
    data = batches(3, seed=6)
    from tests.support.harness import lm_loss

    with offload.initialize(model, cfg) as engine:
        for per_rank in data:
            x, y = on_test_device(*per_rank[0])
            engine.backward(lm_loss(engine(x), y))
            engine.step()
        masters = engine.full_state_dict(master=True)
        compute = engine.full_state_dict()
    for name, master in masters.items():
        assert compute[name].dtype == torch.bfloat16
        assert torch.equal(compute[name], master.to(torch.bfloat16)), name


def test_persistent_small_parameters_stay_on_device(tmp_path):
    """Parameters under stage3_param_persistence_threshold never leave the device."""
    import offload

    model = build("tiny_gpt")
    cfg = make_config("nvme", "nvme", tmp_path, persistence=100)
    with offload.initialize(model, cfg) as engine:
        homes = {s.name: s.home.value for s in engine.shards}
    assert homes["blocks.0.ln1.weight"] == "device"  # 24 elements
    assert homes["blocks.0.fc.weight"] == "nvme"       # 24 x 99
    data = batches(6, seed=7)
    ref_model, _ = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    weights, _, _ = run_engine(model, data, cfg)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach())


def test_deepspeed_buffer_keys_are_honoured_and_change_nothing_numerically(tmp_path):
    """max_in_cpu keeps the first parameters in host memory; buffer_count /
    buffer_size set the staging budgets (a parameter larger than a buffer
    streams through it instead of failing); a small sub_group_size limits
    read-ahead. Training still equals plain PyTorch."""
    import offload

    model = build("tiny_gpt")
    data = batches(6, seed=13)
    cfg = make_config("nvme", "nvme", tmp_path)
    zero = cfg["zero_optimization"]
    zero["offload_param"].update(max_in_cpu=1000, buffer_count=2, buffer_size=100)
    zero["offload_optimizer"]["buffer_count"] = 4
    zero["sub_group_size"] = 50
    with offload.initialize(model, cfg) as engine:
        homes = [s.home.value for s in engine.shards]
        # wte (37x24=888 elements) fits max_in_cpu=1000; the next big one does not.
        assert homes[0] == "host" and "nvme" in homes
        # One store per thread (Note [one store per thread]): the compute
        # thread's parameter store and the optimizer's state store.
        param_store = engine.shards[1].ctx.param_store.store
        state_store = engine.optimizer.states.state_store
        assert param_store.config.buffer_bytes == max(2 * 100 * 4, 2 * 4096)  # the store's minimum
        assert state_store.config.buffer_bytes == 4 * max(s.part_numel for s in engine.shards) * 4
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    weights, losses, _ = run_engine(model, data, cfg)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach())
