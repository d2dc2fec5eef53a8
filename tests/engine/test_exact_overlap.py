"""The host optimizer beside a separate device (the sim), overlapped with its
compute, gives the same bits as the engine on the CPU, which equals plain
PyTorch (tests/engine/test_parity.py and test_fp16.py): updates during backward
(no step-wide check), updates under the next forward (clipping triggered, fp16
loss scaling with a skipped step: Note [updates under the next forward]), with
accumulation, in fp32, bf16 and fp16, and state on NVMe, where the step waits.
The gate of each shard's home on its pending update is shown necessary: without
it, a forward reads a value its update has not written yet."""
import copy
import time

import pytest
import torch

import offload
from offload.step.updates import DeferredUpdates, OverlappedUpdates
from offload.optim.sharded_adam import ShardedAdam
from offload.partition.shard import Shard

from tests.support.harness import batches, build, engine_weights, lm_loss, make_config, train_engine

STEPS = 4
FP16_SKIPS = {"initial_scale_power": 16, "hysteresis": 1, "loss_scale_window": 1000, "min_loss_scale": 1}

# (param, optim, precision, gas, clip, extra config, how the updates run beside the sim's compute)
CASES = [
    ("cpu", "cpu", "fp32", 1, 0.0, None, "during backward"),
    ("cpu", "cpu", "fp32", 2, 0.0, None, "during backward"),
    ("cpu", "cpu", "fp32", 1, 0.05, None, "under the next forward"),
    ("cpu", "cpu", "bf16", 2, 0.05, None, "under the next forward"),
    # bf16 gradients updated straight from their staging buffers (Note [updates from the staging buffer])
    ("cpu", "cpu", "bf16", 1, 0.0, None, "during backward"),
    ("cpu", "cpu", "bf16", 2, 0.0, None, "during backward"),
    ("cpu", "cpu", "fp16", 1, 0.0, {"fp16": {"enabled": True, **FP16_SKIPS}}, "under the next forward"),
    # small parameters homed on the device (the persistence threshold), the rest on the host
    ("cpu", "cpu", "fp32", 2, 0.05, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 200,
                                                           "offload_param": {"device": "cpu"},
                                                           "offload_optimizer": {"device": "cpu"}}},
     "under the next forward"),
    ("cpu", "nvme", "fp32", 2, 0.05, None, "in step"),
    ("nvme", "cpu", "bf16", 1, 0.0, None, "during backward"),
]


def _config(tmp_path, param, optim, precision, gas, clip, extra):
    return make_config(param, optim, tmp_path, precision="bf16" if precision == "bf16" else "fp32",
                       gas=gas, clip=clip, extra=extra)


def _spy(monkeypatch):
    """Counts the updates each path ran (updates under the next forward started, overlapped submits)."""
    seen = {"during backward": 0, "under the next forward": 0}
    submit, start = OverlappedUpdates.submit, DeferredUpdates.start

    def counted_submit(self, shard, **kwargs):
        seen["during backward"] += 1
        return submit(self, shard, **kwargs)

    def counted_start(self, order, **kwargs):
        seen["under the next forward"] += sum(s.gradient.pending for s in order)
        return start(self, order, **kwargs)

    monkeypatch.setattr(OverlappedUpdates, "submit", counted_submit)
    monkeypatch.setattr(DeferredUpdates, "start", counted_start)
    return seen


def _run(model, data, cfg):
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
        counters = (engine.global_steps, engine.skipped_steps)
        layer = engine.device_layer.name
    return losses, weights, counters, layer


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c[:5]) + ("-" + ",".join(c[5]) if c[5] else ""))
def test_overlapped_on_the_sim_equals_the_cpu_engine_bit_for_bit(tmp_path, monkeypatch, case):
    param, optim, precision, gas, clip, extra, how = case
    model, data = build("tiny_gpt"), batches(STEPS * gas, seed=5)
    on_cpu = _run(model, data, _config(tmp_path / "cpu", *case[:6]))
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    monkeypatch.setenv("OFFLOAD_SIM_GBPS", "5")
    seen = _spy(monkeypatch)
    on_sim = _run(model, data, _config(tmp_path / "sim", *case[:6]))
    assert (on_cpu[3], on_sim[3]) == ("cpu", "sim")
    torch.testing.assert_close(on_sim[0], on_cpu[0], rtol=0, atol=0)
    for name, value in on_cpu[1].items():
        torch.testing.assert_close(on_sim[1][name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert on_sim[2] == on_cpu[2]
    if extra is not None and "fp16" in extra:  # the scale 2^16 overflows at first: steps are skipped
        assert on_sim[2][1] >= 1 and on_sim[2][0] >= 1, on_sim[2]
    # The path the case is about ran, and only it.
    if how == "in step":
        assert seen == {"during backward": 0, "under the next forward": 0}
    else:
        other = "under the next forward" if how == "during backward" else "during backward"
        assert seen[how] > 0 and seen[other] == 0, seen


def test_clipping_is_triggered_and_its_terms_are_taken_on_the_host_worker(tmp_path, monkeypatch):
    """The clipped cases above clip: the norm exceeds 0.05 at every step; each shard's
    term of the norm is taken on the host worker during backward (Note [norm terms
    during backward]), none on the compute thread."""
    import threading

    from offload.step import gradients

    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    threads = []
    square_sum = gradients.square_sum
    monkeypatch.setattr(gradients, "square_sum",
                        lambda g, *a: (threads.append(threading.current_thread().name), square_sum(g, *a))[1])
    with offload.initialize(build("tiny_gpt"), _config(tmp_path, "cpu", "cpu", "fp32", 1, 0.05, None)) as engine:
        for per_rank in batches(2, seed=5):
            x, y = per_rank[0]
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            assert engine.get_global_grad_norm() > 0.05
        assert len(threads) == 2 * len(engine.shards) and set(threads) == {"offload-host"}, threads


def test_the_next_forward_waits_for_each_shards_update(tmp_path, monkeypatch):
    """Updates made slow: the next forward still reads every new value. With the
    gate removed (Shard.await_update a no-op) it reads old ones: the losses differ."""
    model, data = build("tiny_gpt"), batches(STEPS, seed=6)
    cfg = _config(tmp_path, "cpu", "cpu", "fp32", 1, 0.05, None)
    expected = _run(model, data, cfg)[0]
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    update = ShardedAdam.update_shard

    def slow_update(self, *args):
        time.sleep(0.01)
        return update(self, *args)

    monkeypatch.setattr(ShardedAdam, "update_shard", slow_update)
    torch.testing.assert_close(_run(model, data, cfg)[0], expected, rtol=0, atol=0)
    monkeypatch.setattr(Shard, "await_update", lambda self: None)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_run(model, data, cfg)[0], expected, rtol=0, atol=0)


def test_bf16_moves_half_the_bytes_of_fp32_over_the_bus(tmp_path, monkeypatch):
    """Gradients go down and parameters up in the compute dtype: a bf16 step copies
    half an fp32 step's bytes between host and device (2 bytes a parameter each way)."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    moved = {}
    for precision in ("fp32", "bf16"):
        cfg = make_config("cpu", "cpu", tmp_path, precision=precision)
        with offload.initialize(build("tiny_gpt"), cfg) as engine:
            for i, per_rank in enumerate(batches(3, seed=1)):
                if i == 2:
                    before = engine.device_layer.counters.bytes_copied
                x, y = per_rank[0]
                engine.backward(lm_loss(engine(x), y))
                engine.step()
            moved[precision] = engine.device_layer.counters.bytes_copied - before
    n = sum(p.numel() for p in build("tiny_gpt").parameters())
    assert moved["fp32"] >= 8 * n  # at least each parameter up and its gradient down, 4 bytes each
    assert moved["bf16"] * 2 == moved["fp32"], moved


def test_a_users_own_loop_with_clipping_on_the_sim_equals_the_cpu_engine(tmp_path, monkeypatch):
    """model(x), loss.backward(), optimizer.step(), optimizer.zero_grad(): the clipped
    step's updates run under the next forward here too, with the same bits."""
    def run(layer):
        monkeypatch.setenv("OFFLOAD_DEVICE", layer)
        cfg = make_config("cpu", "cpu", tmp_path / layer, clip=0.05)
        with offload.initialize(build("tiny_gpt"), cfg) as engine:
            model, opt, losses = engine.module, engine.optimizer, []
            for per_rank in batches(STEPS, seed=2):
                x, y = per_rank[0]
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            return torch.stack(losses), engine_weights(engine), engine.step_runner.phase

    losses_cpu, weights_cpu, _ = run("cpu")
    losses_sim, weights_sim, phase = run("sim")
    assert phase.value == "updates deferred under the next forward"
    torch.testing.assert_close(losses_sim, losses_cpu, rtol=0, atol=0)
    for name, value in weights_cpu.items():
        torch.testing.assert_close(weights_sim[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
