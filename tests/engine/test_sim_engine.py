"""The engine on the simulated asynchronous device (OFFLOAD_DEVICE=sim): every
transfer on a copy stream with seeded jitter, its destination NaN until done,
every access checked against stream order (Note [device layer], Note [copy
streams]). The parity matrix trains like plain PyTorch for three seeds; each
of the engine's waits, removed alone, makes the simulator raise; pinned
memory is allocated in the first step only and stays within its budget."""
import copy

import pytest
import torch

import offload
from offload.device.sim_memory import StreamOrderError
from offload.transfers import device_copies

from tests.support.harness import (batches, build, engine_weights, first_race, make_config, run_engine,
                                  run_reference, run_reference_mixed, train_engine)

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)

SEEDS = [0, 1, 2]
STEPS = 4
CKPT = {"activation_checkpointing": {"modules": ["Block"]}}
NO_PREFETCH = {"stage3_prefetch_bucket_size": 0}
NO_OVERLAP = {"overlap_comm": False}

# (param, optim, precision, gas, activation checkpointing, zero_optimization extras): each
# placement, both precisions, accumulation, checkpointing and prefetch/overlap off, in pairs.
MATRIX = [
    ("cpu", "cpu", "fp32", 1, False, {}),
    ("nvme", "nvme", "fp32", 2, True, {}),
    ("nvme", "cpu", "bf16", 1, False, NO_PREFETCH),
    ("none", "cpu", "fp32", 2, False, NO_OVERLAP),
    ("cpu", "nvme", "bf16", 2, True, NO_OVERLAP),
    ("nvme", "cpu", "fp32", 1, True, {**NO_PREFETCH, **NO_OVERLAP}),
    ("cpu", "cpu", "fp32", 1, False, {"stage3_param_persistence_threshold": 200}),  # device homes too
    ("none", "none", "bf16", 2, True, {}),  # everything on the device: gradients stay there
]


def _config(tmp_path, param, optim, precision, gas, ckpt, zero_extra):
    cfg = make_config(param, optim, tmp_path, precision=precision, gas=gas, extra=CKPT if ckpt else None)
    cfg["zero_optimization"].update(zero_extra)
    return cfg


@pytest.fixture
def sim(monkeypatch):
    """The sim device for engines made in the test; returns a function setting its seed."""
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    monkeypatch.setenv("OFFLOAD_SIM_GBPS", "5")  # slow enough that a copy is often still running
    return lambda seed: monkeypatch.setenv("OFFLOAD_SIM_SEED", str(seed))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", MATRIX, ids=lambda c: "-".join(str(x) for x in c[:5]) + ("-" + ",".join(c[5]) if c[5] else ""))
def test_parity_matrix_on_the_sim_device(tmp_path, sim, seed, case):
    param, optim, precision, gas, ckpt, zero_extra = case
    sim(seed)
    model = build("tiny_gpt")
    data = batches(STEPS, seed=seed)
    if precision == "fp32":
        ref_model, ref_losses = run_reference(model, data, gas=gas, clip=0.0, lr=1e-2, weight_decay=0.01)
    else:
        ref_model, ref_losses = run_reference_mixed(model, data, dtype=torch.bfloat16, gas=gas,
                                                    lr=1e-2, weight_decay=0.01)
    with offload.initialize(copy.deepcopy(model), _config(tmp_path, *case)) as engine:
        losses = train_engine(engine, data)
        weights = engine_weights(engine)
        assert engine.device_layer.name == "sim"
        assert engine.device_layer.counters.copies > 0, "nothing went through the device layer"
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


def test_the_sim_path_equals_the_cpu_path_bit_for_bit(tmp_path, monkeypatch):
    """Same arithmetic, only the transfers differ: the weights are identical."""
    model, data = build("tiny_gpt"), batches(STEPS, seed=7)
    cfg = make_config("nvme", "cpu", tmp_path / "a", gas=2)
    on_cpu, losses_cpu, _ = run_engine(model, data, cfg)
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    on_sim, losses_sim, _ = run_engine(model, data, make_config("nvme", "cpu", tmp_path / "b", gas=2))
    torch.testing.assert_close(losses_sim, losses_cpu, rtol=0, atol=0)
    for name, value in on_cpu.items():
        torch.testing.assert_close(on_sim[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


# What the simulator says when the wait is missing: the access that races the copy.
FIRST_ERROR = {
    "h2d-after-compute": "on stream 'h2d' while compute queued before the allocation",
    "compute-after-h2d": "read by compute (lend) on the default stream while copy",
    "staging-after-h2d": "written by compute (lend) on the host while copy",
    "d2h-after-compute": "on stream 'd2h' while compute (wrote 'gradient of",
    # on the host worker (lend) or, when a released buffer is taken again, in put (__getitem__)
    "host-after-d2h": "buffer 'gradient staging ring' read by compute (",
}


# Where the placement exercises the wait: NVMe staging for staging-after-h2d, host homes otherwise.
@pytest.mark.parametrize("wait", device_copies.WAITS)
def test_each_wait_removed_makes_the_simulator_raise(tmp_path, sim, monkeypatch, wait):
    sim(0)
    monkeypatch.setattr(device_copies, "removed_waits", {wait})
    param = "nvme" if wait == "staging-after-h2d" else "cpu"
    with pytest.raises(StreamOrderError) as raised:
        run_engine(build("tiny_gpt"), batches(3), make_config(param, "cpu", tmp_path))
    first = first_race(raised.value)
    assert FIRST_ERROR[wait] in str(first), str(first)


def test_pinned_memory_is_allocated_in_the_first_step_only_and_stays_within_its_budget(tmp_path, sim):
    sim(1)
    budget = 1 << 20
    cfg = make_config("nvme", "cpu", tmp_path, extra={"memory": {"pinned_budget": budget}})
    with offload.initialize(build("tiny_gpt"), cfg) as engine:
        counters = engine.device_layer.counters
        data = batches(4)
        train_engine(engine, data[:1])
        after_first = counters.pinned_allocations
        assert after_first > 0
        train_engine(engine, data[1:])
        assert counters.pinned_allocations == after_first
        pinned = engine.memory_report()["pinned"]
        assert 0 < pinned["peak"] <= budget == pinned["budget"]


def test_a_pinned_budget_too_small_for_the_gradient_buffers_is_refused_at_initialize(tmp_path, sim):
    model = build("tiny_gpt")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = make_config("cpu", "cpu", tmp_path, extra={"memory": {"pinned_budget": 8192}})
    with pytest.raises(MemoryError, match=r"memory.pinned_budget exceeded allocating \d+ pinned bytes "
                                          r"for gradient staging ring"):
        offload.initialize(model, cfg)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)


def test_homes_built_by_offload_init_are_pinned_and_train_like_plain_pytorch(tmp_path, sim):
    sim(2)
    from tests.support.models import MODELS

    torch.manual_seed(7)
    plain = MODELS["tiny_gpt"]()
    cfg = make_config("cpu", "cpu", tmp_path)
    torch.manual_seed(7)
    with offload.init(cfg):
        model = MODELS["tiny_gpt"]()
    data = batches(STEPS, seed=4)
    ref_model, ref_losses = run_reference(plain, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    with offload.initialize(model, cfg) as engine:
        homes = [s for s in engine.shards if s.home.value == "host"]
        assert homes and all(s.pinned_home for s in homes)
        home_bytes = sum(s.part_numel * s.dtype.itemsize for s in homes)
        assert engine.memory_report()["pinned"]["now"] >= home_bytes
        losses, weights = train_engine(engine, data), engine_weights(engine)
    torch.testing.assert_close(losses, ref_losses[:, 0])
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("param,optim,persistence", [("cpu", "cpu", 200), ("nvme", "cpu", 200),
                                                     ("none", "cpu", 0), ("nvme", "nvme", 0)])
def test_after_the_first_step_every_copy_is_asynchronous(tmp_path, sim, param, optim, persistence):
    """No copy from or to pageable memory (which the layer must copy synchronously):
    host homes, NVMe staging, gradients and device homes' new values all go
    through pinned buffers."""
    sim(0)
    cfg = make_config(param, optim, tmp_path, persistence=persistence)
    with offload.initialize(build("tiny_gpt"), cfg) as engine:
        layer, data = engine.device_layer, batches(3)
        train_engine(engine, data[:1])
        first = len(layer.schedule)
        train_engine(engine, data[1:])
        later = layer.schedule[first:]
        assert later, "no copies after the first step"
        pageable = [(c.stream, c.src, c.dst) for c in later if "pageable host" in (c.src, c.dst)]
        assert not pageable, pageable
        assert {c.stream for c in later} >= ({"h2d", "d2h"} if optim != "none" else {"h2d"})


def test_a_device_budget_too_small_for_host_homes_gathered_is_refused_at_initialize(tmp_path, sim):
    """On a device with memory of its own a host home costs device bytes when gathered
    (no zero-copy gather): initialize counts them, as it does for NVMe homes."""
    cfg = make_config("cpu", "cpu", tmp_path, extra={"memory": {"device_budget": 10_000}})
    with pytest.raises(MemoryError, match=r"needs at least \d+ bytes on the device tier \(offloaded "
                                          r"parameters gathered at once \(working set\)"):
        offload.initialize(build("tiny_gpt"), cfg)
