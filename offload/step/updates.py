"""Optimizer updates overlapped with backward (Note [optimizer overlap]).

Note [optimizer overlap]
In a backward at an accumulation boundary with nothing that needs every
gradient before any update (no clipping, no fp16 overflow check), the engine
calls begin(), then submit(shard) once each shard's gradient is final. The
update runs on the host worker (Note [the host worker] in
offload/host_worker.py) while backward goes on with earlier layers: beside a
separate device submit() is itself called on the host worker, right after the
gradient's copy was taken in, and updates there at once; beside a CPU
backward (NVMe state) it is called on autograd's thread and queues the update.
NVMe state is read ahead in the order the last overlapped step's gradients
arrived (reverse parameter order the first time), written back
asynchronously, and the new compute-dtype value goes to the parameter's home.
A gradient is final when its hook runs (every use of the parameter in this
backward has contributed), so nothing in the rest of backward reads the value
being updated. step() (from engine.step()) then waits only for what is left
(finish), updates shards whose gradient came only in earlier micro-steps, and
publishes device homes: an all-gather is a collective and must run on the
compute thread, in the same order on every rank. Shards whose optimizer state
an auto plan put on the device keep their gradients there and are updated by
finish() on the compute thread, beside the device's other work.

Note [updates under the next forward]
Gradient clipping and the fp16 overflow check need every gradient before any
update, so those updates cannot run during backward. Instead step() computes
the norm (or the check), then hands every update to the host worker in
forward order (DeferredUpdates.start) and returns; each shard's `in_flight.update`
gates every read of its home (Shard.await_update: the copy-in for the next
forward, home_partition, a new gradient) and settle() waits for all of them
(anything that reads optimizer state or every value). So the next forward
waits only for the update of the shard it needs, while the later updates run
beside it. Each update computes exactly what step() would have computed, on
the same gradient: the results are the same bits; no copy of any state is
kept, so the memory cost is nil (the gradients are held until their update,
as they were). Only where nothing in the update can fail on a file: state
and homes on the host or the device (UpdatePolicy.deferred, Note
[when updates run]). A device home's
update runs on the host worker too where its new value goes up the bus right
after it (Note [device homes' new values] in sharded_adam.py); step() runs
the others itself, since their new values are published by the compute
thread (state on the device; an all-gather with several ranks).
"""
from __future__ import annotations

import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from offload.host_worker import HostWorker
from offload.partition.shard import Shard
from offload.partition.shard_context import Residency
from offload.tiers import Tier

if TYPE_CHECKING:
    from offload.optim.state_stream import StateStream
    from offload.step.update_target import UpdateTarget


@dataclass
class ShardUpdate:
    """One shard's update in flight: the call that runs it, and the host bytes it holds."""

    shard: Shard
    done: Future
    grad_elems: int  # its final gradient's elements, held until the update ran
    master_from_gather: bool  # its shared master came from the gathered copy (Note [shared fp32 master])


@dataclass
class OverlappedStep:
    """One overlapped step in progress."""

    groups: list[dict]  # each group's hyperparameters as of the step's start (the LR schedule moves after it)
    stream: "StateStream | None"
    updates: dict[int, ShardUpdate] = field(default_factory=dict)  # by shard.index, in arrival order
    backlog: deque = field(default_factory=deque)  # ShardUpdate queued behind the caller, maybe running
    backlog_elems: int = 0
    stopped: bool = False  # an update raised: the later ones are skipped (Note [a failed step]); not a phase


class TakenInAndUpdated:
    """A gradient on its way to the host worker, then its update there (Note [head
    first after backward] in transfers/device_copies.py): what a read of the shard's
    home waits for. The worker itself never waits on it: its own queue runs in turn."""

    def __init__(self, taken_in: Future, step: OverlappedStep, index: int, worker: HostWorker):
        self.taken_in, self.step, self.index, self.worker = taken_in, step, index, worker

    def result(self) -> None:
        if self.worker.on_worker():
            return
        self.taken_in.result()  # a delivery that raised raises here
        update = self.step.updates.get(self.index)
        if update is not None:  # it ran on the worker as the gradient was taken in
            update.done.result()


class DeferredUpdates:
    """The updates step() left running on the host worker (Note [updates under the next forward])."""

    def __init__(self, optimizer: "UpdateTarget", worker: HostWorker):
        self.optimizer = weakref.proxy(optimizer)  # no cycle: a deleted engine goes without the collector
        self.worker = worker
        self.pending: list[ShardUpdate] = []

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def start(self, order: list[Shard], grad_scale: float | None = None) -> None:
        """Updates each shard of `order` that has a gradient, in that order, on the host worker;
        grad_scale: the clipping coefficient, applied to each gradient first."""
        opt = self.optimizer
        self.settle()
        groups = [dict(g) for g in opt.param_groups]  # the LR schedule moves after step()
        opt.beside_compute(True)  # the compute thread runs the next forward beside them
        # Device homes whose new value step() publishes (state on the device, or an
        # all-gather, a collective, with several ranks) are updated now, here.
        for shard in order:
            if shard.gradient.pending and shard.home is Tier.DEVICE and not opt.uploads_after_update(shard):
                self._update(shard, groups[opt.group_index(shard)], grad_scale)
        opt.flush_publishes()
        for shard in order:
            if shard.gradient.pending:
                done = self.worker.submit(self._update, shard, groups[opt.group_index(shard)], grad_scale)
                shard.in_flight.update = done
                self.pending.append(ShardUpdate(shard, done, shard.part_numel, False))

    def follow(self, shard: Shard, taken_in: Future, step: OverlappedStep) -> None:
        """A gradient copy just started, in a backward whose updates may outlast it
        (Note [head first after backward]): reads of the shard's home, and settle(),
        wait for its take-in and update."""
        waiter = TakenInAndUpdated(taken_in, step, shard.index, self.worker)
        shard.in_flight.update = waiter
        self.pending.append(ShardUpdate(shard, waiter, shard.part_numel, False))

    def _update(self, shard: Shard, group: dict, grad_scale: float | None) -> None:
        if grad_scale is not None:
            shard.gradient.part.mul_(grad_scale)  # as clip_by_global_norm would have, before the update
        self.optimizer.update_shard(shard, group, None)

    def settle(self) -> None:
        """Waits for every update started; raises the first that failed."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        error = None
        with self.optimizer.timeline.span("wait", "optimizer"):
            for update in pending:
                try:
                    update.done.result()
                except BaseException as exc:  # noqa: BLE001 - the first is raised below
                    error = error or exc
                finally:
                    update.shard.in_flight.update = None
        self.optimizer.beside_compute(False)
        self.optimizer.flush_publishes()
        if error is not None:
            raise error


class OverlappedUpdates:
    """The overlapped step of one optimizer (an UpdateTarget: ShardedAdam), run on the host worker it was given."""

    def __init__(self, optimizer: "UpdateTarget", worker: HostWorker, *, pending_grad_elems: int):
        """pending_grad_elems: elements of final gradients queued for their update before
        submit() waits (at least the largest shard)."""
        self.optimizer = weakref.proxy(optimizer)  # no cycle: a deleted engine goes without the collector
        self.worker = worker
        self.pending_grad_elems = pending_grad_elems
        self.step: OverlappedStep | None = None
        # The step carry() ended while its gradients were still going down
        # (Note [head first after backward]): theirs is this one's, until the next begins.
        self.carried: OverlappedStep | None = None
        self.arrival_order: list[Shard] | None = None  # the last overlapped step's gradients, in order
        # Shards whose shared master the last overlapped backward brought from
        # the gathered parameter (Note [shared fp32 master]): not read again.
        self.masters_from_gather: frozenset[int] = frozenset()

    @property
    def active(self) -> bool:
        return self.step is not None

    def begin(self) -> None:
        if self.step is not None:
            raise RuntimeError("an overlapped optimizer step is already in progress")
        opt = self.optimizer
        opt.beside_compute(True)  # backward runs on the compute thread meanwhile
        order = self.arrival_order or list(reversed(opt.shards))
        stream_order = [s for s in order if s.gradient.pending or s.param.requires_grad]
        stream = None
        try:
            if Tier.NVME in opt.states.state_tiers:
                stream = self.worker.submit(opt.open_stream, stream_order, self.masters_from_gather).result()
        except BaseException:
            opt.beside_compute(False)  # no step in progress: a later backward may start one
            raise
        self.step = OverlappedStep(groups=[dict(g) for g in opt.param_groups], stream=stream)
        self.carried = None

    def submit(self, shard: Shard, *, carried: bool = False, master: torch.Tensor | None = None) -> None:
        """The shard's gradient is final: update it on the host worker (at once when called there).
        carried: it went down in a backward whose updates may outlast it (the step
        in progress, or the one carry() ended). master: its shared master, come
        down with the gradient (Note [masters down with their gradients] in
        transfers/device_copies.py): taken by the update at once, on this thread."""
        st, opt = self.step, self.optimizer
        if st is None and carried:
            st = self.carried
        if st is None:
            raise RuntimeError(f"the gradient of {shard.name} arrived for an update in backward, but no "
                               "backward's updates are in progress (begin() first)")
        if shard.index in st.updates:
            # Its update already ran with the gradient it had: a second one
            # would be lost. Autograd accumulates a parameter once per backward.
            raise RuntimeError(f"parameter {shard.name} received a second gradient in one backward "
                               "after its overlapped update started; set "
                               "zero_optimization.offload_optimizer.overlap_updates to false for this model")
        group = st.groups[opt.group_index(shard)]  # the error of a shard in no group is raised here
        inline = self.worker.on_worker()
        if not inline:
            self._wait_backlog(st, shard.part_numel)
        # Beside a separate device the gathered copy is the device's, and may be
        # released by now: the master came down with the gradient, or the host
        # worker reads it from its file.
        charged = False  # a gathered master's host copy is charged; one from the ring is the ring's
        if master is None and not inline:
            master = self._gathered_master(shard)
            charged = master is not None
        if charged:
            opt.account.charge(Tier.HOST, shard.part_numel * 4, f"master of {shard.name} from its gathered copy")
        if inline:  # the gradient was taken in on this thread: its update follows at once
            done: Future = Future()
            try:
                done.set_result(self._run(st, shard, group, master, charged))
            except BaseException as exc:  # noqa: BLE001 - raised by finish(), on the step's thread
                done.set_exception(exc)
        else:
            done = self.worker.submit(self._run, st, shard, group, master, charged)
        update = ShardUpdate(shard, done, shard.part_numel, master is not None)
        st.updates[shard.index] = update
        if not inline:
            st.backlog.append(update)
            st.backlog_elems += update.grad_elems

    def _wait_backlog(self, st: OverlappedStep, numel: int) -> None:
        """Gradients waiting for their update hold host memory (4 bytes/element):
        past the cap, backward waits for the oldest update."""
        while st.backlog and st.backlog_elems + numel > self.pending_grad_elems:
            oldest = st.backlog.popleft()
            if not oldest.done.done():
                with self.optimizer.timeline.span("wait", "optimizer backlog"):
                    oldest.done.exception()
            st.backlog_elems -= oldest.grad_elems

    def finish(self, update_late: bool = True) -> None:
        """Completes the overlapped step: waits for its updates, and with update_late
        updates the shards whose gradient came only in earlier micro-steps."""
        st, opt = self.step, self.optimizer
        self.step = None
        try:
            with opt.timeline.span("wait", "optimizer"):
                opt.beside_compute(False)  # backward is over: the late ones may use every core
                late = [s for s in opt.stepping() if s.index not in st.updates] if update_late else []
                # State on the device: its gradients stayed there and its updates run
                # here, on the compute thread's stream, after the host's.
                on_device = [s for s in late if opt.states.state_tier(s) is Tier.DEVICE]
                waiting = [u.done for u in st.updates.values()]
                waiting += [self.worker.submit(self._run, st, s, st.groups[opt.group_index(s)], None)
                            for s in late if opt.states.state_tier(s) is not Tier.DEVICE]
                error = None
                for done in waiting:
                    try:
                        done.result()
                    except BaseException as exc:  # noqa: BLE001 - the first is raised below
                        error = error or exc
                for s in on_device:
                    try:
                        self._run(st, s, st.groups[opt.group_index(s)], None)
                    except BaseException as exc:  # noqa: BLE001 - the first is raised below
                        error = error or exc
                self.worker.submit(opt.close_stream, st.stream).result()
            if error is not None:
                raise error
        finally:
            arrived = [u.shard for u in st.updates.values()]
            self.arrival_order = arrived + [s for s in opt.shards if s.index not in st.updates]
            self.masters_from_gather = frozenset(i for i, u in st.updates.items() if u.master_from_gather)
            opt.flush_publishes()  # the shards updated, failed step or not

    def carry(self, followed: list[Shard]) -> None:
        """step() after a backward whose updates go on under the next forward (Note [head
        first after backward]): the step ends here; DeferredUpdates.settle waits for them.
        followed: the shards whose gradients went down, in the order they came."""
        self.step, self.carried = None, self.step
        seen = {s.index for s in followed}
        self.arrival_order = followed + [s for s in self.optimizer.shards if s.index not in seen]
        self.masters_from_gather = frozenset()

    def abandon(self) -> None:
        """After a failed backward: waits for the updates already submitted (their
        gradients were final) and starts no others, so no thread is left writing."""
        self.finish(update_late=False)

    def _run(self, st: OverlappedStep, shard: Shard, group: dict, master: torch.Tensor | None,
             charged: bool = False) -> None:
        """charged: `master` is a host copy charged to the host tier, credited here."""
        opt = self.optimizer
        try:
            if st.stopped:  # Note [a failed step]: left, with its gradient, for the retry
                return
            try:
                opt.update_shard(shard, group, st.stream, master)
            except BaseException:
                st.stopped = True
                raise
        finally:
            if charged:
                del master  # the gathered buffer may be reused from here
                opt.account.credit(Tier.HOST, shard.part_numel * 4)

    def _gathered_master(self, shard: Shard) -> torch.Tensor | None:
        """This rank's partition of the gathered parameter, as the shared master
        (Note [shared fp32 master]); None when it is not gathered now. On the
        host it is a view: the gathered buffer is not reused while the view
        lives (offload/aio/memory.py BufferCache)."""
        if not self.optimizer.states.shares_master(shard) or shard.residency is not Residency.GATHERED:
            return None
        start = shard.ctx.pg.rank * shard.part_numel
        flat = shard.param.data.reshape(-1)
        if flat.numel() < start + shard.part_numel:
            return None  # the last rank's padding is not in param.data
        return flat[start:start + shard.part_numel].to("cpu")
