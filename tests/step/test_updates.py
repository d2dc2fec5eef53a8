"""The update schedulers alone (offload/step/updates.py), on a stand-in optimizer that
records each update: updates in backward (OverlappedUpdates) and deferred under the
next forward (DeferredUpdates), their order, their gradients' cap, a failed update and
what it leaves, and the waits every read of a shard relies on. The engine-level runs
(tests/engine/test_exact_overlap.py) show the same updates equal plain PyTorch's."""
import threading

import pytest
import torch

from offload.accounting import MemoryAccount
from offload.host_worker import HostWorker
from offload.partition.shard_context import InFlight, Residency
from offload.partition.shard_gradient import GradientPartition
from offload.step.updates import DeferredUpdates, OverlappedUpdates
from offload.tiers import Tier
from offload.timeline import Timeline


class Shard:
    def __init__(self, index, n):
        self.index, self.part_numel, self.name = index, n, f"p{index}"
        self.home, self.residency, self.in_flight = Tier.HOST, Residency.RELEASED, InFlight()
        self.gradient = GradientPartition(self, Tier.HOST)
        self.gradient.part = torch.zeros(n)
        self.param = torch.nn.Parameter(torch.zeros(n))

    def give(self, value):
        self.gradient.part.fill_(value)
        self.gradient.pending = True


class Optimizer:
    """An UpdateTarget (step/update_target.py) that records (shard name, gradient, lr,
    thread) per update; `fail` names a shard whose update raises, `gate` holds every
    update until set."""

    def __init__(self, shards):
        self.shards, self.param_groups = shards, [{"lr": 0.5}]
        self.account, self.timeline = MemoryAccount({}), Timeline(enabled=False)
        self.states = self  # where the state lives: on the host, not shared with a home
        self.state_tiers = frozenset({Tier.HOST})
        self.updates, self.sharing, self.flushes = [], [], 0
        self.fail, self.gate = None, threading.Event()
        self.gate.set()

    def group_index(self, shard):
        return 0

    def state_tier(self, shard):
        return Tier.HOST

    def shares_master(self, shard):
        return False

    def stepping(self):
        return [s for s in self.shards if s.gradient.pending]

    def open_stream(self, order, skip_master=frozenset()):
        return None

    def close_stream(self, stream):
        pass

    def update_shard(self, shard, group, stream, master_value=None):
        self.gate.wait(10)
        if shard.name == self.fail:
            raise OSError(f"update of {shard.name} failed")
        self.updates.append((shard.name, shard.gradient.part.clone(), group["lr"], threading.current_thread().name))
        shard.gradient.pending = False

    def uploads_after_update(self, shard):
        return True

    def flush_publishes(self):
        self.flushes += 1

    def beside_compute(self, sharing):
        self.sharing.append(sharing)


@pytest.fixture
def worker():
    w = HostWorker()
    yield w
    w.shutdown()


def setup(sizes=(3, 5, 2)):
    shards = [Shard(i, n) for i, n in enumerate(sizes)]
    return shards, Optimizer(shards)


def test_deferred_updates_run_in_the_order_given_on_the_host_worker_each_scaled(worker):
    shards, opt = setup()
    deferred = DeferredUpdates(opt, worker)
    for s, g in zip(shards, (1.0, 2.0, 3.0)):
        s.give(g)
    shards[1].gradient.pending = False  # no gradient this step: not updated
    opt.gate.clear()
    deferred.start([shards[2], shards[1], shards[0]], grad_scale=0.5)
    assert deferred.active and shards[2].in_flight.update is not None and shards[1].in_flight.update is None
    assert opt.updates == []  # left running: start() returned before any ran
    param_groups_lr, opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"], 9.0  # the schedule moves after step()
    opt.gate.set()
    shards[0].in_flight.update.result()  # what a read of the shard's home waits for
    deferred.settle()
    assert [(name, lr) for name, _, lr, _ in opt.updates] == [("p2", param_groups_lr), ("p0", param_groups_lr)]
    torch.testing.assert_close(opt.updates[0][1], torch.full((2,), 1.5))
    torch.testing.assert_close(opt.updates[1][1], torch.full((3,), 0.5))
    assert {thread for *_, thread in opt.updates} != {threading.current_thread().name}
    assert all(s.in_flight.update is None for s in shards) and not deferred.active
    assert opt.sharing == [True, False]  # fewer kernel threads beside the next forward, all after


def test_a_failed_deferred_update_is_raised_once_by_settle_and_the_others_still_run(worker):
    shards, opt = setup()
    deferred = DeferredUpdates(opt, worker)
    for s in shards:
        s.give(1.0)
    opt.fail = "p0"
    deferred.start(shards)
    with pytest.raises(OSError, match="update of p0 failed"):
        shards[0].in_flight.update.result()  # a read of p0 raises it
    with pytest.raises(OSError, match="update of p0 failed"):
        deferred.settle()
    assert [name for name, *_ in opt.updates] == ["p1", "p2"]
    assert shards[0].gradient.pending  # kept: not updated
    deferred.settle()  # raised once: nothing is pending now
    assert all(s.in_flight.update is None for s in shards)


def test_updates_in_backward_follow_arrival_and_step_updates_the_late_ones(worker):
    shards, opt = setup()
    overlapped = OverlappedUpdates(opt, worker, pending_grad_elems=100)
    assert not overlapped.active
    overlapped.begin()
    with pytest.raises(RuntimeError, match="already in progress"):
        overlapped.begin()
    shards[0].give(1.0)  # from an earlier micro-step: no final gradient arrives for it in this backward
    for i in (2, 1):  # reverse order, as backward delivers them
        shards[i].give(float(i))
        overlapped.submit(shards[i])
    with pytest.raises(RuntimeError, match="second gradient in one backward"):
        overlapped.submit(shards[1])
    overlapped.finish()
    assert not overlapped.active
    assert [name for name, *_ in opt.updates] == ["p2", "p1", "p0"]
    assert [s.name for s in overlapped.arrival_order] == ["p2", "p1", "p0"]  # the next step reads state so
    assert opt.sharing[0] is True and opt.sharing[-1] is False


def test_gradients_waiting_for_their_update_are_capped(worker):
    shards, opt = setup((4, 4, 4))
    overlapped = OverlappedUpdates(opt, worker, pending_grad_elems=8)
    overlapped.begin()
    opt.gate.clear()  # every update held
    for s in shards[:2]:
        s.give(1.0)
        overlapped.submit(s)  # 8 elements queued: at the cap
    shards[2].give(1.0)
    third = threading.Thread(target=overlapped.submit, args=(shards[2],))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # backward waits for the oldest update before queueing a third
    opt.gate.set()
    third.join(10)
    assert not third.is_alive()
    overlapped.finish()
    assert [name for name, *_ in opt.updates] == ["p0", "p1", "p2"]


def test_a_failed_update_in_backward_stops_the_later_ones_and_leaves_their_gradients(worker):
    shards, opt = setup()
    overlapped = OverlappedUpdates(opt, worker, pending_grad_elems=100)
    overlapped.begin()
    opt.fail = "p2"
    for i in (2, 1, 0):
        shards[i].give(1.0)
        overlapped.submit(shards[i])
    with pytest.raises(OSError, match="update of p2 failed"):
        overlapped.finish()
    assert opt.updates == [] and all(s.gradient.pending for s in shards)  # Note [a failed step]: all left for the retry
    assert opt.flushes >= 1  # what was updated is published, failed step or not


def test_abandon_waits_for_the_submitted_and_updates_no_late_one(worker):
    shards, opt = setup()
    overlapped = OverlappedUpdates(opt, worker, pending_grad_elems=100)
    overlapped.begin()
    shards[0].give(1.0)  # a late one: abandon leaves it
    shards[2].give(2.0)
    overlapped.submit(shards[2])
    overlapped.abandon()
    assert [name for name, *_ in opt.updates] == ["p2"] and shards[0].gradient.pending and not overlapped.active


def test_carry_ends_the_step_and_its_late_gradients_still_find_it(worker):
    shards, opt = setup()
    overlapped = OverlappedUpdates(opt, worker, pending_grad_elems=100)
    overlapped.begin()
    shards[2].give(1.0)
    overlapped.submit(shards[2])
    overlapped.carry([shards[2]])
    assert not overlapped.active  # the step ended; its gradients still arriving are carried
    shards[1].give(1.0)
    overlapped.submit(shards[1], carried=True)
    with pytest.raises(RuntimeError, match="no backward's updates are in progress"):
        overlapped.submit(shards[0])  # not carried, and no step in progress
    worker.submit(lambda: None).result()  # the worker's queue ran
    assert [name for name, *_ in opt.updates] == ["p2", "p1"]
    assert [s.name for s in overlapped.arrival_order] == ["p2", "p0", "p1"]
