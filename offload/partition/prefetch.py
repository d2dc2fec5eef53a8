"""Reads parameters ahead of their use, in the order the last step used them.

Note [prefetch order]
A pass is one forward (and, in training, the backward that follows it). The
scheduler records the order in which the pass takes parameters into use
(the manager calls `on_use` each time a hold takes a parameter that was not
already held). The order learned for a kind of pass (training or not, grad
enabled or not) drives the next pass of that kind: each time a parameter is
taken into use at the expected position, reads are started for the next ones
in the order, within three limits (zero_optimization keys, in elements):
  stage3_prefetch_bucket_size  elements read ahead and not yet used
  stage3_max_live_parameters   elements gathered, being read or kept for reuse
  stage3_max_reuse_distance    a parameter released whose next use comes
                               within this many elements of other parameters
                               is kept rather than read again (the last layers
                               at the turn from forward to backward)
The first parameter ahead is always read (one parameter above the bucket is
better than a stall). When a pass departs from the order (a dynamic model, a
data-dependent branch, eval between training steps), that pass falls back to
on-demand reads from the point of departure and its own order is learned for
the next: never an error (DeepSpeed's trace-based prefetch raised there).
Prefetches a diverged pass no longer needs are dropped at the end of the pass.

Note [prefetch within the device budget]
Reads ahead and parameters kept for reuse are optional: the step needs
neither. So with memory.device_budget set, a read ahead starts only when its
buffer fits in what the budget leaves now (else the scheduler stops and
tries again at the next use, once something was released), and when a
charge the step does need (a gather, a saved activation) would pass the
budget, the manager first gives back what the scheduler holds (`reclaim`:
retained parameters, reads not yet used) and the charge is tried again
(MemoryAccount reclaimers). So prefetching never turns a budget that trains
without it into a TierBudgetError, and initialize's check
(`budgets.tier_needs` in offload/engine/budgets.py, checked by build.py) counts the scheduler's
live limit plus the one read ahead (`working_set_elems`) so that at an
accepted budget the configured depth has room.
Only transfers are started ahead (`Shard.reads_ahead`): NVMe reads, and on a
device with memory of its own the copy-in of a host home (Note [copy streams]
in device_copies.py); a host home on a CPU-only machine is already the device
copy (Note [zero-copy gather]). Gathers that need collectives run in use
order on the compute thread, the same on every rank.

Note [reads ahead passed a gathered parameter]
The reads ahead skip a parameter that is gathered when they reach its next
use: it is there already. If it is then released before that use (its
hold ends, and its next use lies beyond the reuse distance), nothing reads
it ahead any more, and the use waits for an on-demand read. That was the
turn from forward to backward: the last block, still gathered as the reads
ahead passed its backward uses, released at the end of its forward, read
again as backward began (GPT 67M on NVMe, compiled blocks: 0.07 s a step, a
whole block; eager, its first parameter). So a released parameter whose
next use the reads ahead have passed is kept to that use, within the live
limit: the memory a read ahead would have taken for it anyway, from the
same point on, and no read. Where it is not kept (keeping turned off,
stage3_max_reuse_distance <= 0, or the live limit reached) the reads ahead
go back to that use, so it is read again ahead of it, not on demand.

Note [all-gathers ahead]
With several ranks on a device with memory of its own (ShardContext.streams),
a parameter's all-gather also starts ahead of its use: each time a parameter
is taken into use at the expected position, `gathers_ahead` names the next
ones in the learned order, within half the prefetch bucket (at least the
next one); each has its partition copied in (`Shard.ready_to_gather_ahead`)
and together they start one packed all-gather, asynchronously
(offload/transfers/gather_ahead.py); the first use among them waits the
collective (compute-after-all-gather) and copies every value out. With NCCL an
async collective runs on the communication stream NCCL keeps, and `wait()`
makes the compute stream wait it (the host does not block); on gloo it runs
on gloo's threads and `wait()` blocks the host. Every rank must
issue the same collectives in the same order, or they hang or mix values, so
what is gathered ahead depends only on what every rank has alike: the learned
order, the sizes, the position, and residency, which the same program gives
every rank alike. Not the device budget: a read ahead the budget refuses on
one rank could not take part, so all-gathers ahead run only without
memory.device_budget. Half the bucket: the prefetcher started those reads
one use earlier, so an all-gather ahead rarely waits for the disk. On the cpu
layer, and with one rank, nothing changes. The all-gather's write is not one
the sim can see (it runs on gloo's threads), so compute-after-all-gather is
the one wait no sim test removes; tests/engine/test_collective_bytes.py
counts that every gather but a pass's first was started ahead, and the
two-rank parity tests on the sim (test_distributed.py) check the values.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from offload.partition.shard import Shard
from offload.partition.shard_context import Residency
from offload.tiers import Tier

log = logging.getLogger("offload")


@dataclass
class _Order:
    shards: list[Shard]
    prefix: list[int] = field(default_factory=list)  # prefix[i] = elements used before position i
    positions: dict[int, list[int]] = field(default_factory=dict)  # shard index -> positions

    def __post_init__(self):
        total = 0
        for i, s in enumerate(self.shards):
            self.prefix.append(total)
            total += s.padded_numel
            self.positions.setdefault(s.index, []).append(i)
        self.prefix.append(total)

    def next_use(self, shard: Shard, after: int) -> int | None:
        pos = self.positions.get(shard.index, [])
        i = bisect.bisect_left(pos, after)
        return pos[i] if i < len(pos) else None


class PrefetchScheduler:
    def __init__(self, *, bucket_elems: int, max_live_elems: int, reuse_distance: int,
                 enabled: bool = True, gather_ahead: bool = False):
        """gather_ahead: all-gather parameters ahead of use (Note [all-gathers ahead])."""
        self.bucket_elems = bucket_elems
        self.max_live_elems = max_live_elems
        self.reuse_distance = reuse_distance
        self.enabled = enabled
        self.gather_ahead = gather_ahead and enabled
        self._gathered_to = 0  # all-gathers ahead issued for positions < _gathered_to
        self._orders: dict[tuple, _Order] = {}
        self._order: _Order | None = None
        self._key: tuple | None = None
        self._pos = 0          # next expected position in the order
        self._issued = 0       # reads started for positions < _issued
        self._seen: list[Shard] = []
        self._diverged = True
        self._unused: dict[Shard, int] = {}    # read ahead, not yet taken into use
        self._retained: set[Shard] = set()     # kept for reuse: the scheduler holds one ref
        self._live: dict[Shard, int] = {}      # offloaded shards not RELEASED -> elements
        # missed: taken into use while released, neither read ahead nor kept: read on demand
        self.stats = {"prefetched": 0, "hits": 0, "missed": 0, "diverged_passes": 0, "retained": 0,
                      "deferred_for_budget": 0}

    # ---- pass boundaries -------------------------------------------------
    def begin_pass(self, key: tuple) -> None:
        self.end_pass()
        self._key = key
        self._order = self._orders.get(key) if self.enabled else None
        self._pos = self._issued = self._gathered_to = 0
        self._seen = []
        self._diverged = self._order is None

    def end_pass(self) -> list[Shard]:
        """Learns this pass's order; returns the shards whose scheduler-owned
        state the manager must release (retained ones and unused prefetches)."""
        if self._key is None:
            return []
        finished = self._order is not None and not self._diverged and self._pos == len(self._order.shards)
        if not finished and self._seen:
            if self._order is not None:
                self.stats["diverged_passes"] += 1
            self._orders[self._key] = _Order(self._seen)
        self._key, self._order, self._seen = None, None, []
        leftovers = list(self._retained) + list(self._unused)
        self._retained.clear()
        self._unused.clear()
        return leftovers

    def resize(self, limits: tuple[int, int, int]) -> None:
        """New (bucket, max live, reuse distance), from the next use on (blocks compiled
        after initialize: Note [blocks as the unit of prefetch])."""
        self.bucket_elems, self.max_live_elems, self.reuse_distance = limits

    def is_retained(self, shard: Shard) -> bool:
        return shard in self._retained

    def reclaim(self) -> list[Shard]:
        """Note [prefetch within the device budget]: hands back every shard whose
        device bytes only the scheduler wants (reads not yet used, parameters kept
        for reuse), unused reads first; the manager releases them. The learned
        order stays: a shard handed back is read on demand when its turn comes."""
        handed = list(self._unused) + list(self._retained)
        self._unused.clear()
        self._retained.clear()
        return handed

    # ---- events from the manager -----------------------------------------
    def on_use(self, shard: Shard) -> bool:
        """A hold took `shard` into use. Returns True when the scheduler held a
        reference for it (kept for reuse) that the caller must now drop."""
        if self._key is None:
            return False
        self._seen.append(shard)
        was_retained = shard in self._retained
        if self._unused.pop(shard, None) is not None:
            self.stats["hits"] += 1
        elif not was_retained and shard.reads_ahead and shard not in self._live:
            self.stats["missed"] += 1
        self._retained.discard(shard)
        if shard.home is not Tier.DEVICE:
            self._live[shard] = shard.padded_numel
        if not self._diverged:
            order = self._order.shards
            if self._pos < len(order) and order[self._pos] is shard:
                self._pos += 1
                self._issued = max(self._issued, self._pos)
                self._read_ahead()
            else:
                self._diverged = True
                log.debug("prefetch: pass %s departed from the learned order at position %d "
                          "(%s); on-demand reads until the next pass", self._key, self._pos, shard.name)
        return was_retained

    def gathers_ahead(self) -> list[Shard]:
        """After on_use: the parameters whose all-gather starts now (Note [all-gathers
        ahead]), in order; each is this scheduler's until used, as a read ahead is."""
        if not self.gather_ahead or self._diverged or self._order is None:
            return []
        order, prefix = self._order.shards, self._order.prefix
        limit = prefix[self._pos] + max(1, self.bucket_elems // 2)
        out = []
        self._gathered_to = max(self._gathered_to, self._pos)
        while self._gathered_to < len(order) and prefix[self._gathered_to] < limit:
            s = order[self._gathered_to]
            self._gathered_to += 1
            if s.home is Tier.DEVICE or s in out:
                continue
            if s.residency is Residency.RELEASED:
                self._unused[s] = self._live[s] = s.padded_numel
            out.append(s)
        return out

    def advance(self) -> None:
        """Reads ahead whose bytes are in start their copy-in (Shard.advance)."""
        for shard in self._unused:
            shard.advance()

    def on_released(self, shard: Shard) -> None:
        self._live.pop(shard, None)
        self._unused.pop(shard, None)

    def should_retain(self, shard: Shard) -> bool:
        """The last hold on `shard` is being dropped: keep it instead when its
        next use in the order comes within the reuse distance."""
        if self._diverged or self._order is None or shard.home is Tier.DEVICE:
            return False
        nxt = self._order.next_use(shard, self._pos)
        if nxt is None:
            return False
        between = self._order.prefix[nxt] - self._order.prefix[self._pos]
        # Note [reads ahead passed a gathered parameter]: kept too where the reads ahead went
        # past its next use, else read ahead again from there.
        passed = nxt < self._issued
        keep = between <= self.reuse_distance or (passed and self.reuse_distance > 0)
        if not keep or self._live_elems() > self.max_live_elems:
            if passed:
                self._issued = nxt
            return False
        self._retained.add(shard)
        self.stats["retained"] += 1
        return True

    # ---- reading ahead ---------------------------------------------------
    def _live_elems(self) -> int:
        return sum(self._live.values())

    def _read_ahead(self) -> None:
        order = self._order.shards
        ahead = sum(self._unused.values())
        live = self._live_elems()
        while self._issued < len(order):
            s = order[self._issued]
            if s.reads_ahead and s.residency is Residency.RELEASED:
                n = s.padded_numel
                if self._unused and (ahead + n > self.bucket_elems or live + n > self.max_live_elems):
                    return  # the bucket is full: continue when the next one is used
                if not s.ctx.account.fits(Tier.DEVICE, n * s.dtype.itemsize):
                    # Note [prefetch within the device budget]: fetch less; try
                    # again at the next use, after releases.
                    self.stats["deferred_for_budget"] += 1
                    return
                s.prefetch()
                self._unused[s] = n
                self._live[s] = n
                ahead += n
                live += n
                self.stats["prefetched"] += 1
            self._issued += 1


def prefetch_limits(zero, largest: int) -> tuple[int, int, int]:
    """(bucket, max live, reuse distance) in elements for a zero_optimization
    config, `largest` being the largest offloaded parameter's padded elements, or
    the largest compiled block's where blocks are compiled (Note [blocks as the
    unit of prefetch]).
    Keys left unset are sized from the model, not DeepSpeed's defaults (50M
    elements ahead, 1G live, 1G reuse distance: on a model under a billion
    parameters those keep all of it gathered, which is what offloading is
    meant to avoid):
      bucket        the largest offloaded parameter ahead (more held memory
                    and bought no time on a disk-bound step, GPT 67M)
      max live      three of the largest
      reuse         the largest (the turn from forward to backward)
    A bucket of 0 turns prefetching off, as in DeepSpeed."""
    def pick(value, default):
        return default if value is None else value

    return (pick(zero.stage3_prefetch_bucket_size, largest),
            pick(zero.stage3_max_live_parameters, 3 * largest),
            pick(zero.stage3_max_reuse_distance, largest))


def working_set_elems(zero, padded_numels: list[int], any_nvme: bool, on_demand: int, unit: int = 0) -> int:
    """Elements of offloaded parameters gathered at once, at most: `on_demand`
    (what the step itself holds: the largest set of parameters one module
    gathers together) or, with prefetching on, the scheduler's live limit if
    larger, plus the one read always allowed ahead; never more than all of
    them (Note [prefetch within the device budget]). unit: the elements the largest
    compiled block gathers at once (Note [blocks as the unit of prefetch])."""
    largest = max(padded_numels, default=0)
    bucket, max_live, _ = prefetch_limits(zero, max(largest, unit))
    if not (bucket > 0 and any_nvme):
        return min(sum(padded_numels), on_demand)
    return min(sum(padded_numels), max(on_demand, max_live) + largest)


def prefetch_scheduler(zero, shards: list[Shard], *, device_budget: int | None = None,
                       unit: int = 0) -> PrefetchScheduler:
    """The scheduler for a zero_optimization config (limits: `prefetch_limits`);
    device_budget: memory.device_budget (all-gathers ahead only without one); unit:
    the elements the largest compiled block gathers at once (Note [blocks as the unit of prefetch])."""
    largest = max((s.padded_numel for s in shards if s.home is not Tier.DEVICE), default=0)
    bucket, max_live, reuse = prefetch_limits(zero, max(largest, unit))
    ctx = shards[0].ctx if shards else None
    return PrefetchScheduler(
        bucket_elems=bucket, max_live_elems=max_live, reuse_distance=reuse,
        enabled=bucket > 0 and any(s.reads_ahead for s in shards),
        gather_ahead=(ctx is not None and ctx.streams is not None and ctx.pg.world_size > 1
                      and device_budget is None))
