"""Memory per tier: the engine's own accounting, the budgets it promises, and
the process RSS the OS reports.

The RSS tests run the training in a fresh process (tests/engine/rss_run.py):
RSS belongs to the whole process, so earlier tests' imports and heaps would
be counted. Each measures from a baseline taken after the imports the engine
needs (Note [engine bytes and the OS] in offload/process_memory.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload.aio.swap_store import SwapStore
from offload.aio.swap_config import SwapConfig
from offload.accounting import TierLedger
from offload.accounting import MemoryAccount, Tier, TierBudgetError
from tests.support.harness import make_config
from tests.support.models import Wide

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


# Not harness.train_engine: Wide takes float input and returns its own loss
# (harness trains the token-id models of MODELS on an LM loss).
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
    for param, optim in (("cpu", "cpu"), ("nvme", "nvme")):
        cfg = make_config(param, optim, tmp_path / param)
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
        engine = offload.initialize(Wide(), cfg)
        # A host home is gathered by copy only onto a device with memory of its own.
        copied = param == "nvme" or engine.device_layer.separate_memory
        expected = {param: layer + 8 * act if copied else 9 * act}
        _train(engine)
        report = engine.memory_report()
        engine.close()
        assert report["device"]["peak"] == expected[param], (param, report)
        assert report["device"]["now"] == 0


@pytest.mark.parametrize("live_layers", [pytest.param(None, marks=pytest.mark.slow), 2])
def test_prefetch_stays_within_the_live_limit(tmp_path, live_layers):
    """Parameters gathered, read ahead or kept for reuse stay within
    stage3_max_live_parameters (by default three of the largest parameters,
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
    live = 3 * 1024 * 1024 * 4 if live_layers is None else live_layers * layer
    assert layer + 8 * act < report["device"]["peak"] <= live + layer + 9 * act, report
    assert report["device"]["now"] == 0


def test_budgets_are_enforced_at_initialize(tmp_path):
    cfg = make_config("cpu", "cpu", tmp_path, extra={"memory": {"host_budget": "8MiB"}})
    with pytest.raises(MemoryError, match=r"host tier budget exceeded: .*needs at least \d+ bytes.*8388608"):
        offload.initialize(Wide(layers=2), cfg)


def test_staging_buffers_are_charged_to_the_host_tier(tmp_path):
    """The swap store's pool charges what it allocates and credits what it
    drops (evicting a cached buffer for a new size, closing)."""
    account = MemoryAccount()
    budget = 64 << 10
    store = SwapStore(SwapConfig(nvme_path=str(tmp_path), capacity_bytes=8 * MiB, buffer_bytes=budget),
                      ledger=TierLedger(account, Tier.HOST))
    gen = torch.Generator().manual_seed(0)
    # Sizes that make the pool evict and reallocate: one page, odd, near the budget, larger (streamed).
    for i, numel in enumerate([1, 1023, 7000, 15_000, 40_000, 3]):
        value = torch.randn(numel, generator=gen)
        store.swap_out(f"t{i}", value).wait()
        torch.testing.assert_close(store.swap_in(f"t{i}").wait(), value)
        held = account.usage(Tier.HOST)
        assert held.now == store._pool.allocated_bytes > 0
        assert held.peak <= budget
    store.close()
    assert account.usage(Tier.HOST).now == 0


def test_a_refused_staging_charge_holds_nothing(tmp_path):
    account = MemoryAccount({Tier.HOST: 8 << 10})
    store = SwapStore(SwapConfig(nvme_path=str(tmp_path), capacity_bytes=8 * MiB, buffer_bytes=64 << 10),
                      ledger=TierLedger(account, Tier.HOST))
    with pytest.raises(TierBudgetError, match=r"host tier budget exceeded allocating \d+ bytes for swap staging"):
        store.swap_out("big", torch.zeros(4096))  # 16 KiB + header > the 8 KiB host budget
    assert account.usage(Tier.HOST).now == 0 and store._pool.allocated_bytes == 0
    store.close()


def test_preflight_counts_the_staging_buffers(tmp_path):
    # Wide(layers=2): 2.1M parameters, fp32 gradients 8 MiB; with NVMe the
    # staging budget (two of the largest state files, 24 MiB) comes on top.
    cfg = make_config("nvme", "nvme", tmp_path, extra={"memory": {"host_budget": "16MiB"}})
    with pytest.raises(MemoryError, match=r"host tier budget exceeded: .*swap staging buffers \d+"):
        offload.initialize(Wide(layers=2), cfg)


# ---- RSS against a closed form, in a fresh process -------------------------

# The NVMe run: 16 x Linear(1792, 1792), 51.4M parameters, 196 MiB in fp32;
# plain in-memory training (fp32 weight, gradient, Adam moments) would hold
# 16 bytes/param = 784 MiB.
NVME_RUN = dict(param="nvme", optim="nvme", layers=16, width=1792, batch=32, steps=2)
# The CPU run for the report check: 4 x Linear(2048, 2048), 256 MiB on the host tier.
CPU_RUN = dict(param="cpu", optim="cpu", layers=4, width=2048, batch=32, steps=2)
# Not proportional to the model: library state made on first use (oneDNN/MKL
# GEMM scratch, the native Adam thread pool's stacks, code pages; 12 MiB
# measured after the first step), Python objects, and up to 4 KiB alignment
# padding per staging buffer. Measured headroom with it: docs/ARCHITECTURE.md.
SLACK = 32 * MiB


def _measure(tmp_path, spec) -> dict:
    spec = dict(spec, nvme_path=str(tmp_path / "swap"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "tests.engine.rss_run", json.dumps(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def nvme_run(tmp_path_factory):
    return _measure(tmp_path_factory.mktemp("rss_nvme"), NVME_RUN)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    return _measure(tmp_path_factory.mktemp("rss_cpu"), CPU_RUN)


def closed_form_peak(layers: int, width: int, batch: int, staging_bytes: int,
                     itemsize: int = 4) -> dict[str, int]:
    """Peak host bytes of training `layers` x Linear(width, width) + tanh with
    parameters and optimizer state on NVMe, one rank, on a CPU-only host
    (the device tier is host memory), default prefetch and overlap settings.
    Term by term, docs/ARCHITECTURE.md "Memory budget"."""
    largest = width * width            # the largest parameter (shard), P
    return {
        # Parameters gathered, read ahead or kept for reuse: the live limit
        # (3 P by default) plus the one read always allowed ahead.
        "parameters on the device tier": 4 * largest * itemsize,
        # Final gradients waiting for their overlapped update: the backlog cap
        # (reduce_bucket_size, 2 P by default) plus the one arriving.
        "fp32 gradients awaiting update": 3 * largest * 4,
        "swap staging buffers": staging_bytes,
        # The shard being updated, one largest shard's elements read ahead
        # and one written back, [master | m | v] each.
        "optimizer state buffers": 3 * 3 * 4 * largest,
        # fp32 masters taken from gathered parameters (Note [shared fp32
        # master]), held until their update: at most the gradient backlog.
        "masters from gathered parameters": 3 * largest * 4,
        # New compute-dtype values on their way home: at most 3 in flight.
        "new values being written": 3 * itemsize * largest,
        # Saved: each layer's tanh output and the input; in flight in
        # backward: two activation gradients and the loss's square input.
        "activations": (layers + 3) * batch * width * 4,
        "slack": SLACK,
    }


@pytest.mark.slow
def test_peak_rss_of_nvme_training_is_bounded_by_the_closed_form(nvme_run):
    run = nvme_run
    if not run["peak_reset"]:
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    spec = NVME_RUN
    terms = closed_form_peak(spec["layers"], spec["width"], spec["batch"], run["staging_bytes"])
    budget = sum(terms.values())
    params = spec["layers"] * (spec["width"] ** 2 + spec["width"])
    in_memory = 16 * params
    peak = run["train_peak"] - run["baseline"]
    detail = {k: round(v / MiB, 1) for k, v in terms.items()}
    assert peak <= budget, f"peak RSS growth {peak / MiB:.1f} MiB > closed form {budget / MiB:.1f} MiB {detail}"
    # The bound is meaningful: well under what in-memory training holds.
    assert budget <= 0.6 * in_memory, (budget / MiB, in_memory / MiB)


@pytest.mark.slow
def test_initialize_returns_the_models_tensors_to_the_os(nvme_run):
    """The model's parameters (196 MiB) move to NVMe; their memory must leave
    the process, not linger in malloc's heaps."""
    run = nvme_run
    assert run["after_build"] - run["baseline"] >= run["model_bytes"]  # the model was resident
    init = run["init"]["os"]
    assert init["rss"] - run["baseline"] - init["engine_bytes"] <= 16 * MiB, init
    # The engine's own baseline is the test's, less nothing but stray bytes.
    assert abs(init["baseline_rss"] - run["baseline"]) <= 8 * MiB, (init, run["baseline"])


@pytest.mark.parametrize("which", ["nvme_run", "cpu_run"])
@pytest.mark.slow
def test_memory_report_agrees_with_the_os(which, request):
    """Within 10% of the RSS growth. With parameters and optimizer state on
    NVMe the engine holds little at rest (nothing after initialize, no
    gradients between steps: Note [gradient partitions]), less than the
    constant first-use library state, so that run is held to 10% plus SLACK."""
    run = request.getfixturevalue(which)
    for when, report in [("initialize", run["init"])] + [(f"step {i + 1}", r) for i, r in enumerate(run["steps"])]:
        os_view = report["os"]
        grown = os_view["rss"] - os_view["baseline_rss"]
        slack = SLACK if which == "nvme_run" else 0
        if which == "cpu_run":
            assert grown >= 100 * MiB, os_view  # big enough for 10% to mean something
        assert abs(os_view["unaccounted"]) <= 0.10 * grown + slack, (
            f"after {when}: engine accounts {os_view['engine_bytes'] / MiB:.1f} MiB, "
            f"the OS shows {grown / MiB:.1f} MiB over the baseline")
        assert os_view["engine_bytes"] == report["host"]["now"] + report["device"]["now"]


@pytest.mark.slow
def test_accounted_peaks_cover_the_os_peak(nvme_run):
    """Everything that scales with the model is charged: the OS's peak is
    within the accounted peaks plus activations (the model's own) and SLACK."""
    run, spec = nvme_run, NVME_RUN
    last = run["steps"][-1]
    activations = closed_form_peak(spec["layers"], spec["width"], spec["batch"], 0)["activations"]
    accounted = last["host"]["peak"] + last["device"]["peak"]
    assert run["train_peak"] - run["baseline"] <= accounted + activations + SLACK
