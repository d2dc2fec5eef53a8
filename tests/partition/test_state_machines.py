"""Unit tests of the two state machines under the parameter manager, on the
smallest objects that run them (no engine, no model, no disk):

  Shard residency (offload/partition/shard.py): RELEASED -> FETCHING ->
  GATHERED -> RELEASED, which transitions each state allows, the one refused
  (a release of what is not held), and the device bytes each state costs as
  the Residency docstring says.
  PrefetchScheduler (offload/partition/prefetch.py, Note [prefetch order]):
  the order it learns per kind of pass, the bucket and live limits on reading
  ahead, keeping for reuse, and a pass in another order (slower, never an
  error).

The NVMe home is a fake parameter store whose reads stay in flight until
waited: that makes FETCHING observable and keeps these tests off the disk.
Construction is in make_ctx / make_shard only, so a change to ShardContext
or the tier enums is adapted in one place.
"""
from pathlib import Path

import pytest
import torch
from torch import nn

from offload.accounting import MemoryAccount, TierBudgetError
from offload.transfers.collectives import ProcessGroupInfo
from offload.partition.prefetch import PrefetchScheduler
from offload.partition.shard import Shard
from offload.partition.shard_context import Residency, ShardContext
from offload.tiers import Tier

F32 = torch.float32.itemsize


class _Request:
    """An async transfer: its bytes move when waited (or never, when cancelled)."""

    def __init__(self, move=None):
        self._move, self.waited, self.cancelled = move, False, False

    def done(self):
        return self._move is None

    def wait(self):
        if self._move is not None:
            self._move()
            self._move = None
        self.waited = True

    def cancel(self):
        self._move, self.cancelled = None, True


class FakeParamStore:
    """A PartitionStore (offload/partition/shard.py; the engine's is nvme_home.ParamStore)
    over a dict: writes land at once, reads land when waited."""

    def __init__(self):
        self.parts: dict[int, torch.Tensor] = {}
        self.reads: list[_Request] = []

    def write(self, shard, part, *, borrow=False):
        self.parts[shard.index] = part.detach().clone()
        return _Request()

    def read_part(self, shard, out):
        out.copy_(self.parts[shard.index])
        return _Request()

    def path_of(self, shard):
        return Path(f"/nonexistent/param.{shard.index}.swp")

    def read_full(self, shard, full):
        def move():  # this rank's part in its place (one rank: the whole parameter)
            start = shard.ctx.pg.rank * shard.part_numel
            full[start:start + shard.part_numel].copy_(self.parts[shard.index])
        request = _Request(move)
        self.reads.append(request)
        return request


# ---- construction (the only place that knows how) ---------------------------
def make_ctx(*, rank=0, world_size=1, device_budget=None):
    return ShardContext(device=torch.device("cpu"), pg=ProcessGroupInfo(rank=rank, world_size=world_size),
                        account=MemoryAccount({Tier.DEVICE: device_budget}), param_store=FakeParamStore())


def make_shard(ctx, home=Tier.NVME, numel=10, index=0, value=None):
    """A float32 parameter of `numel` elements taken into `home` (its initial value: `value`)."""
    value = torch.randn(numel, generator=torch.Generator().manual_seed(index)) if value is None else value
    param = nn.Parameter(torch.empty(numel))
    shard = Shard(index, f"p{index}", param, compute_dtype=torch.float32, home=home, ctx=ctx)
    shard.adopt(value)
    return shard


def device_bytes(ctx):
    return ctx.account.usage(Tier.DEVICE).now


# ---- Shard residency -----------------------------------------------------------
def test_nvme_shard_walks_released_fetching_gathered_released():
    ctx = make_ctx()
    value = torch.randn(10, generator=torch.Generator().manual_seed(5))
    s = make_shard(ctx, value=value)
    assert s.residency is Residency.RELEASED and device_bytes(ctx) == 0
    assert s.param.shape == (10,) and s.param.stride() == (0,)  # the placeholder: shape only

    s.prefetch()  # RELEASED -> FETCHING: the full parameter is charged when the read starts
    assert s.residency is Residency.FETCHING
    assert device_bytes(ctx) == s.padded_numel * F32
    read = ctx.param_store.reads[-1]
    assert not read.done()

    data = s.gather()  # FETCHING -> GATHERED: waits the read, charges nothing more
    assert s.residency is Residency.GATHERED and read.waited
    assert device_bytes(ctx) == s.padded_numel * F32
    torch.testing.assert_close(data, value)
    assert s.param.data.data_ptr() == data.data_ptr()

    s.release()  # the last hold: GATHERED -> RELEASED, bytes credited
    assert s.residency is Residency.RELEASED and device_bytes(ctx) == 0
    assert s.param.stride() == (0,)
    torch.testing.assert_close(s.home_partition(), value)  # the home copy stayed authoritative


def test_gather_from_released_reads_on_demand():
    ctx = make_ctx()
    s = make_shard(ctx)
    data = s.gather()  # RELEASED -> GATHERED directly, the read waited inside
    assert s.residency is Residency.GATHERED and ctx.param_store.reads[-1].waited
    assert device_bytes(ctx) == s.padded_numel * F32
    torch.testing.assert_close(data, s.home_partition())


def test_gathered_bytes_are_the_padded_parameter():
    """Rank 1 of 3, 10 elements: parts of 4, 12 padded elements gathered."""
    ctx = make_ctx(rank=1, world_size=3)
    s = make_shard(ctx, numel=10)
    assert (s.part_numel, s.padded_numel) == (4, 12)
    assert ctx.account.usage(Tier.NVME).now == 4 * F32  # the home: this rank's part
    s.prefetch()
    assert device_bytes(ctx) == 12 * F32
    s.gather()
    assert device_bytes(ctx) == 12 * F32
    s.release()
    assert device_bytes(ctx) == 0


def test_holds_are_counted_and_only_the_last_release_frees():
    ctx = make_ctx()
    s = make_shard(ctx)
    first = s.gather()
    second = s.gather()  # GATHERED -> GATHERED: no second read, no second charge
    assert first.data_ptr() == second.data_ptr() and len(ctx.param_store.reads) == 1
    assert s.refs == 2 and device_bytes(ctx) == s.padded_numel * F32
    s.release()
    assert s.residency is Residency.GATHERED and s.held
    s.release()
    assert s.residency is Residency.RELEASED and not s.held and device_bytes(ctx) == 0


@pytest.mark.parametrize("state", ["released", "fetching", "gathered_then_released"])
def test_release_of_a_shard_not_held_is_refused(state):
    ctx = make_ctx()
    s = make_shard(ctx)
    if state == "fetching":
        s.prefetch()  # read in flight, but nobody holds it
    elif state == "gathered_then_released":
        s.gather()
        s.release()
    before = (s.residency, device_bytes(ctx))
    with pytest.raises(RuntimeError, match="release of parameter p0 that is not held"):
        s.release()
    assert (s.residency, device_bytes(ctx), s.refs) == (*before, 0)


def test_prefetch_outside_released_or_of_a_non_nvme_home_is_a_no_op():
    ctx = make_ctx()
    s = make_shard(ctx)
    s.prefetch()
    s.prefetch()  # FETCHING: not read twice, not charged twice
    assert len(ctx.param_store.reads) == 1 and device_bytes(ctx) == s.padded_numel * F32
    s.gather()
    s.prefetch()  # GATHERED
    assert s.residency is Residency.GATHERED and len(ctx.param_store.reads) == 1
    host = make_shard(ctx, Tier.HOST, index=1)
    host.prefetch()  # a host home is gathered on use, never read ahead
    assert host.residency is Residency.RELEASED


def test_force_release_cancels_a_read_and_drops_every_hold():
    ctx = make_ctx()
    s = make_shard(ctx)
    s.prefetch()
    s.force_release()  # FETCHING -> RELEASED: the unused read is cancelled, its bytes credited
    assert ctx.param_store.reads[-1].cancelled
    assert s.residency is Residency.RELEASED and device_bytes(ctx) == 0
    s.gather()
    s.gather()
    s.force_release()  # GATHERED with two holds -> RELEASED
    assert s.residency is Residency.RELEASED and s.refs == 0 and device_bytes(ctx) == 0
    s.force_release()  # RELEASED: nothing to do
    assert s.residency is Residency.RELEASED and device_bytes(ctx) == 0


def test_host_home_gathers_without_a_copy_on_one_cpu_rank():
    """Note [zero-copy gather]: GATHERED costs no device bytes when the host
    partition already is the full parameter."""
    ctx = make_ctx()
    s = make_shard(ctx, Tier.HOST)
    assert ctx.account.usage(Tier.HOST).now == s.part_numel * F32 and device_bytes(ctx) == 0
    data = s.gather()
    assert s.residency is Residency.GATHERED and device_bytes(ctx) == 0
    assert data.data_ptr() == s.host_part.data_ptr()
    s.release()
    assert s.residency is Residency.RELEASED and s.param.stride() == (0,)


def test_device_home_is_gathered_for_good():
    ctx = make_ctx()
    s = make_shard(ctx, Tier.DEVICE)
    assert s.residency is Residency.GATHERED and s.held
    assert device_bytes(ctx) == s.padded_numel * F32
    s.gather()
    s.release()
    s.force_release()
    assert s.residency is Residency.GATHERED and device_bytes(ctx) == s.padded_numel * F32
    with pytest.raises(RuntimeError, match="not held"):
        s.release()
    with pytest.raises(ValueError, match="a device home takes the full value"):
        s.adopt_partition(torch.zeros(s.part_numel))


def test_gather_past_the_device_budget_raises_and_charges_nothing():
    ctx = make_ctx(device_budget=15 * F32)
    small, big = make_shard(ctx, numel=10, index=0), make_shard(ctx, numel=6, index=1)
    small.gather()
    with pytest.raises(TierBudgetError, match="device tier budget exceeded"):
        big.prefetch()
    assert big.residency is Residency.RELEASED and device_bytes(ctx) == 10 * F32


def test_a_gather_refused_by_the_budget_holds_nothing():
    ctx = make_ctx(device_budget=15 * F32)
    small, big = make_shard(ctx, numel=10, index=0), make_shard(ctx, numel=6, index=1)
    small.gather()
    with pytest.raises(TierBudgetError):
        big.gather()
    assert big.residency is Residency.RELEASED and device_bytes(ctx) == 10 * F32
    assert (big.refs, big.held) == (0, False)


# ---- PrefetchScheduler -------------------------------------------------------------
def nvme_shards(n, numel=10):
    ctx = make_ctx()
    return [make_shard(ctx, numel=numel, index=i) for i in range(n)]


def run_pass(sched, order, key=("train",), watch=None):
    """One pass as the parameter manager drives it (offload/partition/manager.py
    hold/drop): each shard taken into use, gathered, then dropped; returns, per
    use, the indices of the shards (of `watch`, default `order`) being read
    (FETCHING) right after it."""
    watch = set(order if watch is None else watch)
    sched.begin_pass(key)
    fetching_after = []
    for s in order:
        if s.refs == 0 or sched.is_retained(s):
            s.prefetch()
            handed_over = sched.on_use(s)
        else:
            handed_over = False
        s.gather()
        if handed_over:
            s.release()
        fetching_after.append([t.index for t in watch if t.residency is Residency.FETCHING])
        if s.refs == 1 and sched.should_retain(s):
            continue
        s.release()
        if not s.held:
            sched.on_released(s)
    for s in sched.end_pass():
        s.force_release()
        sched.on_released(s)
    return [sorted(f) for f in fetching_after]


def scheduler(*, bucket=10, live=30, reuse=-1, enabled=True):
    return PrefetchScheduler(bucket_elems=bucket, max_live_elems=live, reuse_distance=reuse, enabled=enabled)


def test_first_pass_reads_on_demand_and_the_next_follows_its_order():
    shards = nvme_shards(4)
    sched = scheduler()
    assert run_pass(sched, shards) == [[], [], [], []]  # nothing learned yet
    assert sched.stats["prefetched"] == 0
    # The next pass: each use starts the read of the one after it (bucket: one shard).
    assert run_pass(sched, shards) == [[1], [2], [3], []]
    assert (sched.stats["prefetched"], sched.stats["hits"]) == (3, 3)
    assert all(s.residency is Residency.RELEASED for s in shards)
    assert device_bytes(shards[0].ctx) == 0


def test_orders_are_learned_per_kind_of_pass():
    shards = nvme_shards(3)
    sched = scheduler()
    run_pass(sched, shards, key=("train",))
    assert run_pass(sched, shards, key=("eval",)) == [[], [], []]  # another kind: not learned yet
    assert run_pass(sched, shards[::-1], key=("train",))[0] == []  # eval's order did not replace train's
    assert sched.stats["diverged_passes"] == 1


def test_the_bucket_limits_elements_read_ahead():
    shards = nvme_shards(6)
    sched = scheduler(bucket=25, live=1000)
    run_pass(sched, shards)
    # Two shards of 10 fit in 25 elements ahead; the third waits for the next use.
    assert run_pass(sched, shards) == [[1, 2], [2, 3], [3, 4], [4, 5], [5], []]


def test_one_shard_is_read_ahead_even_above_the_bucket():
    shards = nvme_shards(3)
    sched = scheduler(bucket=1)
    run_pass(sched, shards)
    assert run_pass(sched, shards) == [[1], [2], []]


def test_the_live_limit_counts_gathered_and_fetching_elements():
    shards = nvme_shards(5)
    sched = scheduler(bucket=1000, live=30)
    run_pass(sched, shards)
    # While shard 0 is in use (10 live), two reads fit under 30; the first read
    # ahead is always allowed, so the live count is at most one shard over.
    fetching = run_pass(sched, shards)
    assert fetching[0] == [1, 2]
    assert all(len(f) <= 2 for f in fetching)


def test_a_pass_in_another_order_falls_back_to_on_demand_reads_without_error():
    shards = nvme_shards(4)
    sched = scheduler()
    run_pass(sched, shards)
    changed = [shards[0], shards[2], shards[1], shards[3]]
    # Shard 0 is where the order says and starts the read of 1; 2 departs: from
    # there on, reads on demand (the read of 1 already started is used when 1 comes).
    assert run_pass(sched, changed) == [[1], [1], [], []]
    assert sched.stats["diverged_passes"] == 1 and sched.stats["hits"] == 1
    assert all(s.residency is Residency.RELEASED for s in shards) and device_bytes(shards[0].ctx) == 0
    # The changed order is learned: the pass after follows it.
    assert run_pass(sched, changed) == [[2], [1], [3], []]
    assert sched.stats["diverged_passes"] == 1


def test_prefetches_a_shorter_pass_never_used_are_released_at_its_end():
    shards = nvme_shards(4)
    sched = scheduler(bucket=20)
    run_pass(sched, shards)
    assert run_pass(sched, shards[:1], watch=shards) == [[1, 2]]  # the pass stops after shard 0
    assert [r.cancelled for r in shards[0].ctx.param_store.reads[-2:]] == [True, True]
    assert all(s.residency is Residency.RELEASED for s in shards)
    assert device_bytes(shards[0].ctx) == 0


@pytest.mark.parametrize("reuse,reads,retained", [(-1, 5, 0), (10, 4, 1)])
def test_a_parameter_used_again_within_the_reuse_distance_is_kept(reuse, reads, retained):
    """The turn from forward to backward: b comes back after c (10 elements
    between), a after c and b (20). Within a reuse distance of 10, b is kept
    gathered between its two uses instead of being read again; a is not."""
    a, b, c = nvme_shards(3)
    order = [a, b, c, b, a]
    sched = scheduler(bucket=10, live=1000, reuse=reuse)
    run_pass(sched, order)
    before = len(a.ctx.param_store.reads)
    run_pass(sched, order)
    assert len(a.ctx.param_store.reads) - before == reads
    assert sched.stats["retained"] == retained
    assert all(s.residency is Residency.RELEASED and s.refs == 0 for s in (a, b, c))
    assert device_bytes(a.ctx) == 0


def test_a_disabled_scheduler_never_reads_ahead():
    shards = nvme_shards(3)
    sched = scheduler(enabled=False)
    for _ in range(3):
        assert run_pass(sched, shards) == [[], [], []]
    assert sched.stats["prefetched"] == 0


def _nested_pass(sched, a, b, c, e, d):
    """a; b held while c is used (a module gathering b around a submodule using c); b
    dropped; e; b again; d. Returns (reads started in the pass, b kept from its drop)."""
    def use(s):  # as run_pass: the reference kept for reuse passes to this hold
        handed_over = False
        if s.refs == 0 or sched.is_retained(s):
            s.prefetch()
            handed_over = sched.on_use(s)
        s.gather()
        if handed_over:
            s.release()

    def drop(s):
        if s.refs == 1 and sched.should_retain(s):
            return True
        s.release()
        if not s.held:
            sched.on_released(s)
        return False

    before = len(a.ctx.param_store.reads)
    sched.begin_pass(("train",))
    use(a), drop(a), use(b), use(c), drop(c)
    kept = drop(b)
    use(e), drop(e), use(b), drop(b), use(d), drop(d)
    for s in sched.end_pass():
        s.force_release()
        sched.on_released(s)
    return len(a.ctx.param_store.reads) - before, kept


@pytest.mark.parametrize("reuse", [5, -1], ids=["keeping", "keeping off"])
def test_a_parameter_the_reads_ahead_passed_while_it_was_held_is_kept_or_read_ahead_again(reuse):
    """Note [reads ahead passed a gathered parameter]: b's second use is 20 elements
    after its drop, past the reuse distance, but the reads ahead went past it while b
    was held. Kept to that use (no read) where keeping is on; with it off, read ahead
    again from its drop, not on demand."""
    a, b, c, e, d = nvme_shards(5)
    sched = scheduler(bucket=40, live=1000, reuse=reuse)
    _nested_pass(sched, a, b, c, e, d)  # learns the order
    missed = sched.stats["missed"]
    reads, kept = _nested_pass(sched, a, b, c, e, d)
    assert kept is (reuse > 0)
    assert reads == (5 if kept else 6)  # each shard once, and b twice where it was not kept
    assert sched.stats["missed"] - missed == 1  # a, the pass's first: nothing read on demand after it
    assert all(s.residency is Residency.RELEASED and s.refs == 0 for s in (a, b, c, e, d))
    assert device_bytes(a.ctx) == 0
