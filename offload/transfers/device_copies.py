"""Copies between the host and a separate device, on side streams.

Note [copy streams]
Where the device has memory of its own (cuda; the simulator, Note [device
layer] in offload/device/layer.py), every host<->device copy of the engine
runs on a side stream of the layer, so a copy overlaps compute instead of
holding it up, and each consumer waits on the event of exactly the copy it
needs, nothing more. The waits, each one tested necessary by removing it
(tests/engine/test_sim_engine.py, `WAITS`):

  h2d-after-compute   the h2d stream waits the compute stream before it
                      writes a buffer just allocated: device memory comes
                      from the compute stream's pool, which compute queued
                      so far may still use (CopyStreams.to_device);
  compute-after-h2d   compute waits the event of a parameter's copy-in
                      before the parameter is handed to the model or to a
                      collective (Shard._await_copy_in);
  staging-after-h2d   an NVMe staging buffer goes back to its pool only once
                      the copy out of it has completed (ParamStore._release_after);
  d2h-after-compute   the d2h stream waits the compute stream before it
                      copies a gradient autograd just wrote (GradientsToHost.put);
  host-after-d2h      the optimizer's side reads a gradient's pinned buffer
                      only after that copy's event (GradientsToHost.drain).

Parameters go host->device on the `h2d` stream when the prefetcher reads
them ahead (Note [prefetch order]) or, at the latest, when the step takes
them into use; gradients go device->host on the `d2h` stream as backward
produces them, into pinned buffers of a small pool; each copy is a typed
record (GradientCopy: buffer and event) handed to the host worker, which
waits for the event and adds the gradient into its fp32 partition (Note [the
host worker] in offload/host_worker.py). Autograd's thread never waits for a
copy: only for a free buffer, while the host worker is behind; the end of
backward waits until every record is taken in. A device home's new value (the optimizer writes it in pageable
memory) goes up through a pinned upload buffer (`to_device_staged`), so every
copy after the first step is asynchronous; a buffer is written again only
after the copy that read it completed. A device buffer or gradient is freed only once no copy uses it
(`DeviceLayer.free`; on cuda, record_stream). On the cpu layer none of this
runs: the device is the host, and the engine keeps its direct path (Note
[zero-copy gather] in partition/shard.py).
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from offload.aio.buffer_pool import BufferPool
from offload.aio.memory import round_up
from offload.transfers.staging_ring import StagingRing
from offload.device import DeviceLayer, Event
from offload.host_worker import HostWorker
from offload.accounting import TierBudgetError
from offload.tiers import Tier

GRADIENT_BUFFERS = 4  # the staging ring holds this many of the largest gradient
UPLOAD_BUFFERS = 4  # device homes' new values in flight host->device at once


def ring_bytes(largest_bytes: int) -> int:
    """Host bytes of the gradient staging ring, for gradients of at most `largest_bytes`
    (made with the manager; reserved by initialize: engine/budgets.py tier_needs)."""
    return round_up(GRADIENT_BUFFERS * max(largest_bytes, 4096))


def upload_pool(largest_bytes: int) -> tuple[int, int]:
    """(pool budget, buffer bytes) of the pinned upload buffers for device homes of at
    most `largest_bytes`."""
    return UPLOAD_BUFFERS * max(largest_bytes, 4096), round_up(max(largest_bytes, 1))


def upload_pool_bytes(largest_bytes: int) -> int:
    """Host bytes those buffers take, made at once (as many whole buffers as the budget holds)."""
    budget, buffer = upload_pool(largest_bytes)
    return budget // buffer * buffer

# The waits of Note [copy streams], by name. Tests remove one at a time to show
# the simulator catches its absence (tests/engine/test_sim_engine.py); nothing else may.
WAITS = ("h2d-after-compute", "compute-after-h2d", "staging-after-h2d", "d2h-after-compute", "host-after-d2h")
removed_waits: set[str] = set()

# Note [head first after backward]
# Where each update follows its gradient's take-in on the host worker and
# may be carried under the next forward (UpdatePolicy.carried: Note [update
# names] in step/update_policy.py), the end of backward does not wait for the
# worker: the backward's BackwardPlan (above) says so, every
# gradient put in the ring is `carried` (DeferredUpdates.follow sets the shard's
# in_flight.update to "taken in and updated", so any read of its home waits,
# and settle() waits for all), and step() leaves them running and turns the
# worker head first: the records not yet taken in go newest first. The
# newest came last in backward, from the layers nearest the input, which the
# next forward needs first. So backward runs ahead of the host Adam by what
# the ring holds, and the next forward runs beside the rest of the updates,
# each layer waiting only for its own (an H200 host, GPT 0.94B in bf16:
# backward had run at Adam's pace, 0.387 s, then the forward 0.058 s beside
# an idle Adam). The same updates on the same gradients: the same bits.

# Note [masters down with their gradients]
# With fp32 parameters and optimizer state both on NVMe the parameter's file
# is the master (Note [shared fp32 master] in optim/states.py), and an
# update during backward takes it from the gathered parameter instead of the
# disk. On a separate device that copy is the device's, released once its
# backward has run, so the update used to read the master from NVMe again:
# a third read of every parameter per step, at the disk's rate. Instead,
# when the engine says so (`brings_master`: the update follows this
# gradient's take-in), the gradient's put also clones the parameter's own
# partition on the compute stream (the gathered buffer is released right
# after) and copies it down behind the gradient, into the same piece of the
# ring; the take-in hands it to the update as its master. The bus carries
# 4 more bytes per element (GPT 67M: 0.27 GB at ~55 GB/s, some 5 ms of the
# d2h stream) where the disk read 0.27 GB at 1.7-3.3 GB/s. Where the clone
# finds no room in the device budget, or the parameter is no longer
# gathered, the gradient goes down alone and the stream reads the master.


def waits(name: str) -> bool:
    """Whether the wait `name` (one of WAITS) is made."""
    return name not in removed_waits



@dataclass(frozen=True)
class BackwardPlan:
    """One backward's plan for the gradients going down, handed to GradientsToHost
    when the backward starts (GradientsToHost.begin_backward).

    carried: the updates of this backward may be carried under the next forward
    (Note [update names] in step/update_policy.py); each copy, as it starts, is then handed to
    `follow(shard, taken_in)`, so that its update runs right after the gradient is
    taken in, and backward's end does not wait for the copies (Note [head first
    after backward] above)."""

    follow: Callable[[object, Future], None] | None = None

    @property
    def carried(self) -> bool:
        return self.follow is not None


NO_PLAN = BackwardPlan()  # a backward whose gradients are all in before step() reads them


class CopyStreams:
    """The engine's two copy streams and the compute stream (Note [copy streams])."""

    def __init__(self, layer: DeviceLayer):
        self.layer = layer
        self.compute = layer.current_stream()
        self.h2d = layer.stream("h2d")
        self.d2h = layer.stream("d2h")
        self.uploads: BufferPool | None = None  # pinned buffers for to_device_staged
        self._uploading: deque = deque()  # (event, buffer) of staged copies not known to be done
        # Staged uploads come from the host worker (device homes' new values) and
        # from the compute thread (checkpoint loads, several ranks' publishes).
        self._upload_lock = threading.Lock()

    def make_upload_pool(self, largest_bytes: int, *, ledger=None, pin: bool = False) -> None:
        """Pinned buffers for copies of pageable values (device homes' new values): made
        now, at initialize, so a pinned_budget too small for them fails here."""
        budget, buffer = upload_pool(largest_bytes)
        self.uploads = BufferPool(budget, pin=pin, ledger=ledger, buffer_bytes=buffer,
                                  what="upload staging buffer", register=self.layer.register_pinned)
        self.uploads.fill()

    def to_device_staged(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """dst (device) <- src (pageable host, free to change once this returns): through a
        pinned buffer, so the copy itself is asynchronous. Without an upload pool, the
        layer copies the pageable value synchronously."""
        if self.uploads is None:
            return self.to_device(dst, src)
        nbytes = src.numel() * src.element_size()
        with self._upload_lock:
            buf = self.uploads.try_acquire(nbytes)
            while buf is None:  # every buffer still feeds a copy: the oldest's turn
                self._reclaim_upload(wait=True)
                buf = self.uploads.try_acquire(nbytes)
            staged = self.layer.lend(buf, write=True)[:nbytes].view(src.dtype)
            staged.copy_(src.reshape(-1))
            event = self.to_device(dst, buf[:nbytes].view(src.dtype))
            self._uploading.append((event, buf))
            while self._uploading and self._uploading[0][0].query():
                self._reclaim_upload(wait=False)
            return event

    def _reclaim_upload(self, *, wait: bool) -> None:
        event, buf = self._uploading.popleft()
        if wait:
            event.synchronize()  # a staged buffer is written again only after its copy read it
        self.uploads.release(buf)

    def close(self) -> None:
        with self._upload_lock:
            while self._uploading:
                self._reclaim_upload(wait=True)
        if self.uploads is not None:
            self.uploads.close()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Starts dst (device) <- src (host) on the h2d stream."""
        if waits("h2d-after-compute"):
            self.h2d.wait_stream(self.compute)
        return self.layer.copy(dst, src, self.h2d)

    def wait(self, event: Event) -> None:
        """Compute continues after `event` (compute-after-h2d)."""
        if waits("compute-after-h2d"):
            self.compute.wait_event(event)


@dataclass
class GradientCopy:
    """One gradient on its way device->host (Note [copy streams]): the piece of the
    staging ring it lands in, paired with the event that completes the copy."""

    shard: object
    on_device: torch.Tensor  # autograd's gradient, freed once the copy has read it
    buffer: torch.Tensor  # its piece of the ring, released once delivered
    host: torch.Tensor  # the gradient's view of it
    copied: Event
    taken_in: Future  # done once delivered (or dropped); a carried delivery's error is its exception
    carried: bool  # Note [head first after backward]: its error goes to taken_in alone
    # Note [masters down with their gradients]: the parameter's partition, cloned on the
    # device (freed once copied), and its view in the same piece of the ring; or None.
    master_on_device: torch.Tensor | None = None
    master: torch.Tensor | None = None


class GradientsToHost:
    """Gradients device->host during backward (Note [copy streams]).

    deliver(shard, grad): the gradient, now on the host (a view into the pinned
    ring, valid during the call), to add into the shard's partition. It runs
    on the host worker (Note [the host worker] in offload/host_worker.py),
    after the copy's event: autograd's thread only starts copies.
    plan: the backward's BackwardPlan (above), handed in by
    begin_backward: where its updates are carried under the next forward (Note
    [head first after backward]), plan.follow(shard, taken_in) is called as each
    copy starts, whose delivery is then deliver(shard, grad, carried=True).
    brings_master(shard): given at construction (the step's hooks); whether the
    parameter's own partition goes down with its gradient (Note [masters down with
    their gradients]), then delivered as deliver(shard, grad, master=...)."""

    def __init__(self, streams: CopyStreams, largest_bytes: int, deliver, worker: HostWorker,
                 brings_master=None, ledger=None, pin: bool = False):
        self.streams = streams
        self.layer = streams.layer
        self._deliver = deliver
        self.worker = worker
        # The bytes four of the largest gradient's buffers took (Note [gradient staging ring]):
        # of a trainable parameter (a frozen one has no gradient), grown when one is unfrozen.
        self._pin, self._ledger = pin, ledger
        self.ring = StagingRing(ring_bytes(largest_bytes), pin=pin, ledger=ledger,
                                layer=self.layer, what="gradient staging ring")
        self.plan = NO_PLAN
        self.brings_master = brings_master
        self._lock = threading.Condition()
        self._queue: deque[GradientCopy] = deque()  # started, not yet picked up by the worker
        self._head_first = False
        self._in_flight = 0  # started and not yet delivered (or dropped)
        self._deliver_now = True  # False after a failed backward: what is in flight is dropped
        self._error: BaseException | None = None  # the first delivery not carried that raised

    def put(self, shard, grad: torch.Tensor) -> None:
        """Starts the copy of `grad`, which compute just wrote, to the host. Waits
        only while the ring has no room, the host worker not having taken enough in."""
        flat = grad.detach().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        master_on_device = self._clone_master(shard)
        at = round_up(nbytes)  # the master's bytes start at an aligned offset of the piece
        buf = self.ring.acquire(nbytes if master_on_device is None else at + shard.part_numel * 4)
        try:
            on_device = self.layer.adopt(flat, f"gradient of {shard.name}")
            host = buf[:nbytes].view(flat.dtype)
            master = None if master_on_device is None else buf[at:at + shard.part_numel * 4].view(torch.float32)
            if waits("d2h-after-compute"):
                self.streams.d2h.wait_stream(self.streams.compute)
            copied = self.layer.copy(host, on_device, self.streams.d2h)
            if master is not None:  # behind the gradient on the same stream: one event for both
                copied = self.layer.copy(master, master_on_device, self.streams.d2h)
            record = GradientCopy(shard, on_device, buf, host, copied, Future(), self.plan.carried,
                                  master_on_device, master)
        except BaseException:
            self.ring.release(buf)  # no copy started: nothing will take it in
            if master_on_device is not None:
                self._free_master(shard, master_on_device)
            raise
        with self._lock:
            self._in_flight += 1
            self._queue.append(record)
        if self.plan.carried:
            self.plan.follow(shard, record.taken_in)
        self.worker.submit(self._take_next)

    def _clone_master(self, shard) -> torch.Tensor | None:
        """The parameter's own partition, cloned on the compute stream, where it goes down
        with the gradient (Note [masters down with their gradients]); else None."""
        if self.brings_master is None or not self.brings_master(shard):
            return None
        device_part = shard.gathered_own_part()
        if device_part is None:
            return None
        nbytes = shard.part_numel * 4
        try:
            shard.ctx.account.charge(Tier.DEVICE, nbytes, f"master of {shard.name} going down")
        except TierBudgetError:
            return None  # no room for the clone: the stream reads the master from its file
        try:
            clone = self.layer.alloc(shard.part_numel, torch.float32, f"master of {shard.name}")
            self.layer.lend(clone, write=True).copy_(device_part)
        except BaseException:
            shard.ctx.account.credit(Tier.DEVICE, nbytes)
            raise
        return clone

    def _free_master(self, shard, clone: torch.Tensor) -> None:
        try:
            self.layer.free(clone)
        finally:
            shard.ctx.account.credit(Tier.DEVICE, shard.part_numel * 4)

    def begin_backward(self, plan: BackwardPlan) -> None:
        """The plan of the backward starting now (NO_PLAN: its gradients are all in
        before step() reads them)."""
        self.plan = plan

    def head_first(self) -> None:
        """The records not yet taken in go newest first (Note [head first after backward])."""
        with self._lock:
            self._head_first = bool(self._queue)

    def drain(self) -> None:
        """Every gradient started is in its partition (the end of backward); a
        delivery that raised raises here."""
        self._wait_taken_in()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def discard(self) -> None:
        """A backward that raised: the copies finish, their gradients are dropped."""
        self._deliver_now = False
        try:
            self._wait_taken_in()
        finally:
            self._deliver_now, self._error = True, None

    def close(self) -> None:
        self.discard()
        self.ring.close()

    def ring_growth(self, largest_bytes: int) -> int:
        """Host bytes the ring grows by to take gradients of `largest_bytes` (0: it does)."""
        return max(0, ring_bytes(largest_bytes) - self.ring.capacity)

    def grow_ring(self, largest_bytes: int) -> None:
        """A larger ring, for a parameter unfrozen since it was made; called between steps,
        with no gradient in it (its updates settled). The new ring is charged before
        the old one goes: a refused charge leaves the old one in place."""
        if not self.ring_growth(largest_bytes):
            return
        self._wait_taken_in()
        if self.ring.in_use_bytes:
            raise RuntimeError(f"gradient staging ring: {self.ring.in_use_bytes} bytes still in use; "
                               "it grows only between steps")
        new = StagingRing(ring_bytes(largest_bytes), pin=self._pin, ledger=self._ledger, layer=self.layer,
                          what="gradient staging ring")
        old, self.ring = self.ring, new
        old.close()

    def _wait_taken_in(self) -> None:
        if self.worker.on_worker():
            raise RuntimeError("GradientsToHost: waited on from the host worker, which delivers them")
        with self._lock:
            while self._in_flight:
                self._lock.wait()

    def _take_next(self) -> None:
        with self._lock:
            record = self._queue.pop() if self._head_first else self._queue.popleft()
            if not self._queue:
                self._head_first = False
        self._take_in(record)

    def _take_in(self, record: GradientCopy) -> None:
        """On the host worker: waits for the copy, then adds the gradient into its partition."""
        error = None
        try:
            if waits("host-after-d2h"):
                record.copied.synchronize()
            if self._deliver_now and self._error is None:
                view = self.layer.lend(record.host, write=False)
                extra = {} if record.master is None else {"master": self.layer.lend(record.master, write=False)}
                if record.carried:  # its update belongs to the step that carried it, over or not
                    self._deliver(record.shard, view, carried=True, **extra)
                else:
                    self._deliver(record.shard, view, **extra)
        except BaseException as exc:  # noqa: BLE001 - raised on autograd's side, by drain
            error = exc
        finally:
            try:
                try:
                    self.layer.free(record.on_device)
                finally:
                    if record.master_on_device is not None:
                        self._free_master(record.shard, record.master_on_device)
            except BaseException as exc:  # noqa: BLE001 - the sim's race report; raised by drain
                error = error or exc
            finally:
                self.ring.release(record.buffer)
                with self._lock:
                    if error is not None and not record.carried:
                        self._error = self._error or error
                    self._in_flight -= 1
                    self._lock.notify_all()
                if error is not None and record.carried:
                    record.taken_in.set_exception(error)
                else:
                    record.taken_in.set_result(None)
