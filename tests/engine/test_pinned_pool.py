"""The staging pool between NVMe and the device (Note [staging pool] in
offload/aio/buffer_pool.py), pin_memory and memory.pinned_budget (Note
[pin_memory] in offload/config/sections.py).

On this CPU-only host a parameter read stages only with several ranks; the
engine tests force the staged path on one rank by patching
`nvme_home.stages_reads` (the one decision build.py and ParamStore share),
so the pool's reuse is seen in one process, in seconds, and the values still
go through the same all-gather call (a copy with one rank)."""
import threading
import time

import pytest
import torch

import offload
from offload.aio import memory
from offload.aio.buffer_pool import BufferPool, PinnedLedger
from offload.config import Config, ConfigError
from offload.transfers import nvme_home
from offload.tiers import Tier
from tests.support.harness import batches, build, make_config, run_reference, train_engine, engine_weights


@pytest.fixture
def staged(monkeypatch):
    """Forces the staged path; returns the list of reads that asked (one entry each)."""
    asked = []
    monkeypatch.setattr(nvme_home, "stages_reads", lambda world_size, device: asked.append(1) or True)
    return asked


def _count_staging_allocations(monkeypatch):
    """Counts the aligned host tensors a parameter read allocates for itself
    (before the pool: one per staged read, `aligned_tensor` in nvme_home)."""
    calls = []
    real = nvme_home.aligned_tensor

    def counted(numel, dtype, pin=None):
        calls.append(numel)
        return real(numel, dtype, pin=pin)

    monkeypatch.setattr(nvme_home, "aligned_tensor", counted)
    return calls


def test_staged_nvme_reads_allocate_nothing_after_the_first_step_and_train_exactly(tmp_path, monkeypatch, staged):
    model = build("tiny_gpt")
    data = batches(5)
    ref_model, ref_losses = run_reference(model, data, gas=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    cfg = make_config("nvme", "cpu", tmp_path)
    calls = _count_staging_allocations(monkeypatch)
    staging_reads = staged
    with offload.initialize(model, cfg) as engine:
        pool = engine.shard_context.param_store.staging
        losses = [train_engine(engine, data[:1])]
        after_first = len(calls)
        reads_after_first = len(staging_reads)
        losses.append(train_engine(engine, data[1:]))
        assert len(staging_reads) > reads_after_first  # steps 2..5 did stage their reads
        assert calls[after_first:] == []  # ...and allocated nothing for them,
        assert pool is not None and pool.allocations == pool.depth  # all made at initialize
        assert pool.in_use_bytes == 0
        weights = engine_weights(engine)
    torch.testing.assert_close(torch.cat(losses), ref_losses[:, 0], rtol=0, atol=0)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_staging_pool_is_charged_to_the_host_tier(tmp_path, staged):
    with offload.initialize(build("tiny_gpt"), make_config("nvme", "cpu", tmp_path)) as engine:
        pool = engine.shard_context.param_store.staging
        assert pool.allocated_bytes == pool.depth * pool.buffer_bytes
        before = engine.account.usage(Tier.HOST).now
        pool.clear()  # as ParamStore.close does: its bytes are credited
        assert engine.account.usage(Tier.HOST).now == before - pool.depth * pool.buffer_bytes


class _CountingLedger:
    """Passes charges and credits on to `inner`, counting the bytes credited."""

    def __init__(self, inner):
        self.inner, self.credited = inner, 0

    def charge(self, n, what):
        self.inner.charge(n, what)

    def credit(self, n):
        self.credited += n
        self.inner.credit(n)


def test_engine_close_releases_the_staging_pool_and_its_host_charge(tmp_path, staged):
    engine = offload.initialize(build("tiny_gpt"), make_config("nvme", "cpu", tmp_path))
    account, pool = engine.account, engine.shard_context.param_store.staging
    pool_bytes = pool.depth * pool.buffer_bytes
    pool._ledger = ledger = _CountingLedger(pool._ledger)  # charged pool_bytes at initialize (fill)
    train_engine(engine, batches(2))
    held = account.usage(Tier.HOST).now
    engine.close()
    assert pool.allocated_bytes == 0 and pool.closed
    assert ledger.credited == pool_bytes  # the host tier holds none of the pool's bytes
    assert account.usage(Tier.HOST).now <= held - pool_bytes
    engine.close()  # idempotent: nothing credited twice
    assert ledger.credited == pool_bytes


def test_memory_report_shows_pinned_bytes_now_peak_and_budget(tmp_path, staged, monkeypatch):
    # Pinning as with CUDA (this host has none: the buffers themselves stay pageable).
    from offload.aio import buffer_pool
    from offload.engine import build as build_mod
    real = buffer_pool.aligned_empty
    monkeypatch.setattr(build_mod, "pins", lambda *, cuda, pin_memory: pin_memory)
    monkeypatch.setattr(buffer_pool, "aligned_empty", lambda nbytes, pin=None: real(nbytes, pin=False))
    cfg = make_config("nvme", "cpu", tmp_path)
    cfg["memory"] = {"pinned_budget": 1 << 20}
    engine = offload.initialize(build("tiny_gpt"), cfg)
    account, pool = engine.account, engine.shard_context.param_store.staging
    pool_bytes = pool.depth * pool.buffer_bytes
    train_engine(engine, batches(2))
    report = engine.memory_report()
    assert report["pinned"] == {"now": pool_bytes, "peak": pool_bytes, "budget": 1 << 20}
    assert report["host"]["now"] >= pool_bytes  # pinned bytes are host bytes
    account.reset_peak()
    engine.close()
    assert account.report()["pinned"] == {"now": 0, "peak": pool_bytes, "budget": 1 << 20}
    # pin_memory false: a staging pool all the same, nothing pinned; no budget set: None.
    unpinned = make_config("nvme", "cpu", tmp_path / "unpinned")
    unpinned["zero_optimization"]["offload_param"]["pin_memory"] = False
    with offload.initialize(build("tiny_gpt"), unpinned) as engine:
        assert engine.shard_context.param_store.staging.allocated_bytes > 0
        assert engine.memory_report()["pinned"] == {"now": 0, "peak": 0, "budget": None}


class _LooksPinned(torch.Tensor):
    """A host tensor that says it is pinned: this host has no CUDA to pin with."""

    def is_pinned(self, device=None):
        return True


def test_discarding_a_pinned_host_home_credits_the_pinned_budget(tmp_path, monkeypatch):
    from offload.engine import build as build_mod
    monkeypatch.setattr(build_mod, "pins", lambda *, cuda, pin_memory: pin_memory)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.as_subclass(_LooksPinned))
    with offload.initialize(build("tiny_gpt"), make_config("cpu", "cpu", tmp_path)) as engine:
        homes = [s for s in engine.shards if s.home is Tier.HOST]
        home_bytes = sum(s.part_numel * s.dtype.itemsize for s in homes)
        assert engine.memory_report()["pinned"]["now"] == home_bytes > 0  # every home pinned (no budget)
        shard, host = homes[0], engine.account.usage(Tier.HOST).now
        nbytes = shard.part_numel * shard.dtype.itemsize
        build_mod.discard_home(shard)
        assert engine.memory_report()["pinned"]["now"] == home_bytes - nbytes
        assert engine.account.usage(Tier.HOST).now == host - nbytes  # credited once, not twice


def test_a_buffer_released_after_close_is_dropped_and_credited():
    host = _Host()
    pool = BufferPool(2 * 8192, pin=False, buffer_bytes=8192, ledger=host, what="t")
    pool.fill()
    held = pool.acquire(10)  # a transfer still in flight at close
    pool.close()
    assert host.now == 8192 and pool.allocated_bytes == 8192
    pool.release(held)
    assert host.now == 0 and pool.allocated_bytes == 0 and pool.in_use_bytes == 0
    pool.close()
    assert host.now == 0


def test_reads_ahead_never_take_the_last_buffer():
    """Note [staging buffers for reads ahead]: the buffer the step waits on stays free."""
    pool = BufferPool(2 * 8192, pin=False, buffer_bytes=8192, what="t")
    ahead = pool.try_acquire(100, keep_free_bytes=8192)
    assert ahead is not None
    assert pool.try_acquire(100, keep_free_bytes=8192) is None  # would take the last one
    needed = pool.try_acquire(100)
    assert needed is not None and pool.allocations == 2
    assert pool.try_acquire(1) is None  # never beyond the bound
    pool.release(ahead)
    pool.release(needed)
    assert pool.try_acquire(8192) is not None and pool.allocations == 2  # reused


def test_acquire_waits_for_a_release_and_names_the_pool_when_none_comes():
    pool = BufferPool(8192, pin=False, buffer_bytes=8192, what="parameter staging buffer")
    held = pool.acquire(10)
    threading.Timer(0.2, pool.release, args=(held,)).start()
    t0 = time.perf_counter()
    again = pool.acquire(10, timeout=10)
    assert time.perf_counter() - t0 >= 0.15 and again.data_ptr() == held.data_ptr()
    with pytest.raises(TimeoutError, match=r"parameter staging buffer: no buffer of 10 bytes came free"):
        pool.acquire(10, timeout=0.1)
    with pytest.raises(ValueError, match="exceeds the pool's buffers of 8192"):
        pool.try_acquire(8193)


class _Host:
    def __init__(self):
        self.now = 0

    def charge(self, n, what):
        self.now += n

    def credit(self, n):
        self.now -= n


def test_pinned_ledger_keeps_the_budget_and_charges_the_host_tier():
    host = _Host()
    pinned = PinnedLedger(host, budget=10_000)
    pinned.charge(8192, "a")
    assert host.now == 8192 and pinned.now == 8192
    with pytest.raises(MemoryError, match=r"memory.pinned_budget exceeded allocating 4096 pinned bytes for b: "
                                          r"8192 of 10000 bytes already pinned"):
        pinned.charge(4096, "b")
    assert host.now == 8192  # a refused charge leaves nothing held
    pinned.charge(1000, "home", host_charged=True)
    assert host.now == 8192 and pinned.now == 9192
    pool = BufferPool(3 * 8192, pin=False, buffer_bytes=8192, ledger=PinnedLedger(host, budget=2 * 8192))
    with pytest.raises(MemoryError, match="pinned_budget exceeded"):
        pool.fill()  # 3 buffers do not fit a budget of 2


@pytest.mark.parametrize("cuda,pin_memory,committed,budget,expected", [
    (False, True, 0, None, False),       # a CPU-only host pins nothing
    (True, False, 0, None, False),       # pin_memory false: never
    (True, True, 0, None, True),         # no budget: always
    (True, True, 6000, 10_000, True),    # fits what is left
    (True, True, 6001, 10_000, False),   # does not: stays pageable
])
def test_host_home_pinning_decision(cuda, pin_memory, committed, budget, expected):
    assert memory.pin_host_home(4000, cuda=cuda, pin_memory=pin_memory, pinned_committed=committed,
                                pinned_budget=budget) is expected


def _plan(tmp_path, extra_zero=None, memory_section=None):
    cfg = make_config("nvme", "cpu", tmp_path)
    cfg["zero_optimization"]["offload_param"].update(extra_zero or {})
    if memory_section:
        cfg["memory"] = memory_section
    return Config.from_dict(cfg)


def test_a_pinned_budget_below_two_of_the_largest_partition_is_refused_at_initialize(tmp_path, monkeypatch):
    # staging_plan decides with the device it is told of: one with memory of its own pins.
    from offload.engine.stores import staging_plan
    model = build("tiny_gpt")
    cfg = _plan(tmp_path, memory_section={"pinned_budget": 4096})
    from offload.engine.build import HomePolicy, _Planned
    from offload.partition.shard_context import partition_numel
    policy = HomePolicy(cfg)
    planned = []
    for i, (n, p) in enumerate(model.named_parameters()):
        home = policy.home_of(p)
        planned.append(_Planned(i, n, p, home, partition_numel(p.numel(), 1), p.numel(), None, home=home))
    from offload.device.sim import SimDevice
    cuda = SimDevice()
    largest = memory.round_up(max(pl.part_numel for pl in planned) * 4)
    with pytest.raises(MemoryError, match=rf"memory.pinned_budget is 4096 bytes but the parameter staging pool "
                                          rf"needs at least {2 * largest} \(2 buffers of the largest NVMe "
                                          rf"partition, {largest} bytes.*raise memory.pinned_budget to at "
                                          rf"least {2 * largest}, or set zero_optimization.offload_param."
                                          rf"pin_memory to false"):
        staging_plan(planned, cfg, torch.float32, cuda.separate_memory, 1)
    # pin_memory false: nothing is pinned, so the pinned budget does not bound the pool
    unpinned = _plan(tmp_path, {"pin_memory": False}, {"pinned_budget": 4096})
    assert staging_plan(planned, unpinned, torch.float32, cuda.separate_memory, 1)[0] == largest
    # a budget of exactly two buffers: a pool of two
    exact = _plan(tmp_path, memory_section={"pinned_budget": 2 * largest})
    assert staging_plan(planned, exact, torch.float32, cuda.separate_memory, 1) == (largest, 2)
    # the engine itself refuses at initialize, on the simulated device (which pins), before any
    # parameter moves: the model keeps its values
    monkeypatch.setenv("OFFLOAD_DEVICE", "sim")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    small = make_config("nvme", "cpu", tmp_path / "refused")
    small["memory"] = {"pinned_budget": 4096}
    with pytest.raises(MemoryError, match=r"memory.pinned_budget is 4096 bytes but the parameter staging pool"):
        offload.initialize(model, small)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)


def test_pin_memory_and_pinned_budget_are_checked_keys():
    with pytest.raises(ConfigError, match="zero_optimization.offload_param.pin_memory: 'yes' is not true or false"):
        Config.from_dict({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "yes"}}})
    with pytest.raises(ConfigError, match=r"memory.pinned_budget: 2048 bytes is more than memory.host_budget "
                                          r"\(1024\).*lower it to at most 1024"):
        Config.from_dict({"memory": {"pinned_budget": 2048, "host_budget": 1024}})
    assert Config.from_dict({"memory": {"pinned_budget": "1MiB"}}).memory.pinned_budget == 1 << 20


def test_cpu_host_with_one_rank_keeps_direct_reads(tmp_path):
    with offload.initialize(build("tiny_gpt"), make_config("nvme", "cpu", tmp_path)) as engine:
        assert engine.shard_context.param_store.staging is None
