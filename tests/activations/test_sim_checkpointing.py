"""cpu_checkpointing on the simulated asynchronous device (OFFLOAD_DEVICE=sim):
each checkpoint input goes device->host on the d2h stream into a pinned pool
and back on the h2d stream (Note [pinned checkpoint inputs] in
offload/activations/saver.py). Training equals plain PyTorch for three
seeds; each input is copied twice per step through the layer; the pool
allocates in the first step only; inputs the pool cannot hold go to
pageable memory; each of the saver's waits, removed alone, makes the
simulator raise."""
import copy

import pytest
import torch

import offload
from offload.activations import saver as saver_module
from offload.device.sim_memory import StreamOrderError

from tests.support.harness import (batches, build, engine_weights, first_race, lm_loss, make_config,
                                  run_reference, run_reference_mixed, train_engine)

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)

SEEDS = [0, 1, 2]
STEPS = 4
CKPT = {"activation_checkpointing": {"modules": ["Block"]}}
CKPT_HOST = {"activation_checkpointing": {"modules": ["Block"], "cpu_checkpointing": True}}
INPUTS_PER_STEP = 2  # tiny_gpt: two Blocks, one tensor input each


@pytest.fixture
def sim(monkeypatch):
    """The sim device for engines made in the test; returns a function setting its seed."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    monkeypatch.setenv("OFFLOAD_SIM_GBPS", "5")  # slow enough that a copy is often still running
    return lambda seed: monkeypatch.setenv("OFFLOAD_SIM_SEED", str(seed))


def _input_copies(engine) -> list:
    """The sim's copies of checkpoint inputs, in order (the layer names their buffers)."""
    return [s for s in engine.device_layer.schedule if "checkpoint input" in s.src + s.dst]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_cpu_checkpointing_on_the_sim_device_trains_like_plain_pytorch(tmp_path, sim, seed, param, precision):
    sim(seed)
    model = build("tiny_gpt")
    data = batches(STEPS, seed=seed)
    if precision == "fp32":
        ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    else:
        ref_model, ref_losses = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=1,
                                                    lr=1e-2, weight_decay=0.01)
    cfg = make_config(param, "cpu", tmp_path, precision=precision, extra=CKPT_HOST)
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        pinned_after = []
        losses = []
        for step in data:
            losses.append(train_engine(engine, [step]))
            pinned_after.append(engine.device_layer.counters.pinned_allocations)
        weights = engine_weights(engine)
        copies = _input_copies(engine)
        pool = engine.activation_checkpointing.saver.pinned_inputs.pool
    # Down and back, each through a pinned buffer of the pool, allocated in the first step only.
    assert [(s.stream, s.dst.startswith("pinned")) for s in copies] == \
        STEPS * (INPUTS_PER_STEP * [("d2h", True)] + INPUTS_PER_STEP * [("h2d", False)])
    assert pinned_after == STEPS * pinned_after[:1]
    assert pool.allocations == INPUTS_PER_STEP
    torch.testing.assert_close(torch.cat(losses), ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_each_checkpoint_input_adds_two_layer_copies_per_step(tmp_path, sim):
    """Against checkpointing on the device, cpu_checkpointing adds exactly one copy
    down and one back per checkpoint input and step, counted by the layer."""
    sim(0)
    per_step = {}
    for name, extra in (("device", CKPT), ("host", CKPT_HOST)):
        with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path / name, extra=extra)) as engine:
            counters = engine.device_layer.counters
            deltas = []
            for step in batches(3):
                before = counters.copies
                train_engine(engine, [step])
                deltas.append(counters.copies - before)
        per_step[name] = deltas
    assert [h - d for h, d in zip(per_step["host"], per_step["device"])] == 3 * [2 * INPUTS_PER_STEP]


def test_inputs_the_pinned_budget_cannot_hold_go_to_pageable_memory(tmp_path, sim):
    """memory.pinned_budget leaves room for one input's buffer: the other goes to
    pageable memory (copied synchronously), no error, the same training, and no
    pinned allocation after the first step; its bytes are charged to the host
    tier only while they live."""
    sim(1)
    model = build("tiny_gpt")
    data = batches(STEPS, seed=3)
    with offload.initialize(copy.deepcopy(model), make_config("cpu", "cpu", tmp_path / "a", extra=CKPT_HOST)) as engine:
        pinned_at_start = engine.memory_report()["pinned"]["now"]
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    budget = pinned_at_start + 4096  # one input's buffer: 3 x 7 x 24 fp32, rounded to 4096
    cfg = make_config("cpu", "cpu", tmp_path / "b", extra={**CKPT_HOST, "memory": {"pinned_budget": budget}})
    with offload.initialize(copy.deepcopy(model), cfg) as engine:
        counters, saver = engine.device_layer.counters, engine.activation_checkpointing.saver
        losses, pinned_after, host_now = [], [], []
        for step in data:
            losses.append(train_engine(engine, [step]))
            pinned_after.append(counters.pinned_allocations)
            host_now.append(engine.memory_report()["host"]["now"])
            assert saver.held_storages() == 0  # the pageable copies' charges went with them
        weights = engine_weights(engine)
        copies = _input_copies(engine)
        assert engine.memory_report()["pinned"]["peak"] <= budget
        assert saver.pinned_inputs.pool.allocations == 1
        # The pageable copy is on the host tier while it lives; the pooled one is the pool's charge.
        x, y = batches(1, seed=4)[0][0]
        loss = lm_loss(engine(x), y)
        assert engine.memory_report()["host"]["now"] == host_now[-1] + 3 * 7 * 24 * 4
        del loss
        assert engine.memory_report()["host"]["now"] == host_now[-1]
    down = [s.dst for s in copies if s.stream == "d2h"]
    assert down == STEPS * ["pinned checkpoint input", "pageable host"]
    assert len(copies) == 2 * INPUTS_PER_STEP * STEPS
    assert pinned_after == STEPS * pinned_after[:1]
    assert host_now == STEPS * host_now[:1]
    torch.testing.assert_close(torch.cat(losses), ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_a_dropped_graph_gives_its_pinned_buffers_back(tmp_path, sim):
    """A forward never backpropagated: its inputs' buffers go back to the pool
    (after their copies), and the next steps reuse them."""
    sim(2)
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path, extra=CKPT_HOST)) as engine:
        pool = engine.activation_checkpointing.saver.pinned_inputs.pool
        x, y = batches(1, seed=5)[0][0]
        loss = lm_loss(engine(x), y)
        assert pool.in_use_bytes == INPUTS_PER_STEP * 4096
        del loss
        train_engine(engine, batches(2))
        assert pool.allocations == INPUTS_PER_STEP  # the dropped graph's buffers, reused


# What the simulator says when the wait is missing: the access that races the copy.
FIRST_ERROR = {
    "input-d2h-after-compute": "on stream 'd2h' while compute (wrote 'checkpoint input",
    "input-h2d-after-d2h": "read by copy #",
}


@pytest.mark.parametrize("wait", saver_module.WAITS)
def test_each_wait_removed_makes_the_simulator_raise(tmp_path, sim, monkeypatch, wait):
    sim(0)
    monkeypatch.setattr(saver_module, "removed_waits", {wait})
    # Gradients and state stay on the device: the host worker, which waits for
    # gradients' d2h copies, would order the host after the input's copy too (the
    # sim has one host lane for all host threads) and could hide the race.
    with pytest.raises(StreamOrderError) as raised:
        with offload.initialize(build("tiny_gpt"), make_config("none", "none", tmp_path, extra=CKPT_HOST)) as engine:
            train_engine(engine, batches(3))
    first = first_race(raised.value)
    assert FIRST_ERROR[wait] in str(first), str(first)
    assert "checkpoint input" in str(first), str(first)
