"""The `sim` device layer: a simulated accelerator on CPU with real asynchrony.

For tests (Note [device layer] in device/layer.py). Each side stream is a
worker thread that runs its queue in order; the default stream is the
calling thread, so compute on it is immediate and its waits block the
caller. A copy sleeps its modeled time (bytes / `gbps` plus a jitter drawn
from `random.Random(seed)` when it is enqueued, so one seed gives one
schedule) and its destination holds the poison pattern until it completes:
from when it is enqueued if nothing else still uses the destination, else
from when the stream reaches it. Every access is also checked against the
stream order (Note [sim stream order] in device/sim_memory.py), so a missing
wait raises whatever the timing; `check_order=False` leaves only the poison,
to show what a missing wait does to the numbers. With a `ComputeRate`, device
compute takes a modeled time too, slept on the calling thread (Note [sim
modeled compute] in device/sim_compute.py).
"""
from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from offload.device.layer import DeviceLayer, Event, Stream, nbytes
from offload.device.sim_compute import ComputeClock, ComputeCounters, ComputeRate
from offload.device.sim_memory import (
    DEFAULT_LANE, HOST_LANE, Access, SimDeviceTensor, SimPinnedTensor, SimRecord, SimTensor,
    StreamOrderError, VectorClock, check_access, note_access, plain, poison, record_of, wrap_buffer,
)

DEFAULT_GBPS = 25.0
DEFAULT_JITTER_S = 200e-6


@dataclass
class CopySpan:
    """One copy as the simulator scheduled and ran it (the timeline of item 7)."""

    index: int
    stream: str
    src: str
    dst: str
    nbytes: int
    modeled_s: float  # bytes / bandwidth + jitter, drawn at enqueue
    started: float | None = None  # time.perf_counter() on the worker
    finished: float | None = None


class SimEvent(Event):
    def __init__(self, layer: "SimDevice") -> None:
        self._layer = layer
        self.clock: VectorClock | None = None  # None: never recorded
        self.done = threading.Event()
        # On the default stream with modeled compute: when the modeled device reaches
        # it (its data is there already; whoever waits it waits that long too).
        self.ready_at = 0.0

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, SimStream), f"not a sim stream: {stream!r}"
        with self._layer.lock:
            self.clock = VectorClock(stream.clock)
            self.done = done = threading.Event()  # a re-record leaves earlier waiters on the old one
            if stream.worker is None:
                # The default stream's work is done when the caller gets here; with modeled
                # compute the event completes when the modeled device has run it, and the
                # host goes on queuing meanwhile (Note [sim modeled compute]).
                self.ready_at = self._layer.compute_free_at()
                done.set()
            else:
                self.ready_at = 0.0
                stream.enqueue(done.set)

    def _ready(self) -> bool:
        return self.done.is_set() and time.perf_counter() >= self.ready_at

    def wait_ready(self) -> None:
        """Blocks until the event completed (and the modeled device reached it)."""
        self.done.wait()
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def query(self) -> bool:
        self._layer.raise_worker_error()
        if self.clock is None:
            return True
        if not self._ready():
            return False
        with self._layer.lock:  # as on CUDA, a query that saw it done orders the host after it
            self._layer.host.clock.merge(self.clock)
        return True

    def synchronize(self) -> None:
        if self.clock is None:
            return
        if not self._ready():  # the caller blocks: recorded (Note [hidden transfer time])
            start = time.perf_counter()
            self.wait_ready()
            self._layer.blocked.append((start, time.perf_counter(), threading.current_thread().name))
        self._layer.raise_worker_error()
        with self._layer.lock:
            self._layer.host.clock.merge(self.clock)


class SimStream(Stream):
    def __init__(self, layer: "SimDevice", name: str, lane: int, worker: bool) -> None:
        self.name = name
        self.lane = lane
        self.clock = VectorClock({lane: 0})
        self._layer = layer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.worker = None
        if worker:
            self.worker = threading.Thread(target=self._run, name=f"sim-stream-{name}", daemon=True)
            self.worker.start()

    def __repr__(self) -> str:
        return f"SimStream({self.name!r})"

    def enqueue(self, fn) -> None:
        self._queue.put(fn)

    def _run(self) -> None:
        while (fn := self._queue.get()) is not None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced at the next synchronize
                self._layer.worker_errors.append(exc)

    def stop(self) -> None:
        if self.worker is not None:
            self._queue.put(None)
            self.worker.join()

    def next_seq(self) -> int:
        self.clock[self.lane] += 1
        return self.clock[self.lane]

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, SimEvent), f"not a sim event: {event!r}"
        if event.clock is None:
            return  # as on CUDA: waiting an event never recorded waits for nothing
        if self.worker is None:
            # The default stream is the calling thread: its wait blocks the caller. It
            # orders later default-stream work, not the host's own reads (as on CUDA).
            if not event.done.is_set():  # the caller blocks: recorded (Note [hidden transfer time])
                # With modeled compute the device is busy until free_at: only the wait past
                # it is the device's (Note [sim modeled compute]); the host's own is not.
                start = max(time.perf_counter(), self._layer.compute_free_at())
                event.done.wait()  # the data must be there: the host runs the compute after it
                end = time.perf_counter()
                if end > start:
                    self._layer.blocked.append((start, end, threading.current_thread().name))
                self._layer.compute_advance_to(end)  # the modeled device idled until the copy landed
            self._layer.raise_worker_error()
            with self._layer.lock:
                self.clock.merge(event.clock)
            return
        with self._layer.lock:
            self.clock.merge(self._layer.host.clock)
            self.clock.merge(event.clock)
            self.enqueue(event.wait_ready)

    def wait_stream(self, other: Stream) -> None:
        marker = self._layer.event()
        marker.record(other)
        self.wait_event(marker)

    def synchronize(self) -> None:
        marker = self._layer.event()
        marker.record(self)
        marker.synchronize()


class SimDevice(DeviceLayer):
    name = "sim"

    def __init__(self, seed: int = 0, gbps: float = DEFAULT_GBPS, jitter_s: float = DEFAULT_JITTER_S,
                 check_order: bool = True, compute: ComputeRate | None = None, poison_memory: bool = True) -> None:
        if not gbps > 0:
            raise ValueError(f"sim device: bandwidth {gbps!r} GB/s; expected a number > 0")
        if not jitter_s >= 0:
            raise ValueError(f"sim device: jitter {jitter_s!r} s; expected a number >= 0")
        super().__init__()
        self.device = torch.device("cpu")  # compute runs here, on SimDeviceTensors
        self.seed, self.gbps, self.jitter_s, self.check_order = seed, gbps, jitter_s, check_order
        # False: fresh memory and copies' destinations are not filled with the poison
        # pattern (for timing with modeled compute: it is host work a GPU does not do);
        # the stream-order checks still catch every missing wait.
        self.poison_memory = poison_memory
        self.lock = threading.RLock()  # every record and clock (Note [sim stream order])
        self._rng = random.Random(seed)
        self.host = SimStream(self, "host", HOST_LANE, worker=False)  # host threads' own accesses
        self.default = SimStream(self, "default", DEFAULT_LANE, worker=False)
        self._streams: list[SimStream] = []
        self.schedule: list[CopySpan] = []
        self.worker_errors: list[BaseException] = []
        self._by_storage: dict[int, list] = {}  # storage address -> [(start, end, wrapper ref, record)]
        self._tracked = 0
        # (start, end, thread name) of each wait that blocked a host thread: the default
        # stream's wait_event, Event/Stream/layer synchronize (Note [hidden transfer time]).
        self.blocked: list[tuple[float, float, str]] = []
        # Device compute's modeled time, slept on this thread (Note [sim modeled compute]); None: not modeled.
        self.compute = ComputeClock(self, compute) if compute is not None and compute.modeled else None

    def describe(self) -> str:
        return (f"sim (seed {self.seed}, {self.gbps:g} GB/s, jitter up to {self.jitter_s * 1e6:g} us, "
                f"stream-order checks {'on' if self.check_order else 'off'}"
                f"{', ' + self.compute.rate.describe() if self.compute else ''})")

    # -- modeled compute (Note [sim modeled compute]) ---------------------------

    @property
    def modeled_compute_s(self) -> float:
        """The modeled time of the device compute since the layer was built or last reset (0: off)."""
        return self.compute.counters.modeled_s if self.compute else 0.0

    def reset_modeled_compute(self) -> ComputeCounters:
        """The compute counters so far (ops, FLOPs, bytes, modeled and slept seconds); restarts them."""
        return self.compute.reset() if self.compute else ComputeCounters()

    def compute_free_at(self) -> float:
        """time.perf_counter() when the modeled device has run what was queued (0: not modeled)."""
        return self.compute.free_at if self.compute is not None else 0.0

    def compute_advance_to(self, when: float) -> None:
        """The modeled device waited (a copy the default stream waited on) until `when`."""
        if self.compute is not None:
            self.compute.advance_to(when)

    def settle_compute(self) -> None:
        """Sleep what the compute queued so far still owes (on the compute thread)."""
        if self.compute is not None:
            self.compute.settle()

    def _own_work(self):
        """The layer's work on the compute thread, which is not device compute."""
        return self.compute.unmodeled() if self.compute is not None else contextlib.nullcontext()

    # -- memory -----------------------------------------------------------

    def alloc(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype)
        if self.poison_memory:
            poison(buf)  # fresh device memory is garbage; make reading it before a write visible
        self.counters.allocated(buf)
        # Written by the default stream at the allocation (Note [sim stream order]).
        with self.lock:
            last = Access(DEFAULT_LANE, self.default.clock[DEFAULT_LANE], "default",
                          "compute queued before the allocation")
        return self._track(wrap_buffer(buf, SimDeviceTensor, SimRecord(name, "device", last_write=last, layer=self)))

    def pinned(self, numel: int, dtype: torch.dtype, name: str = "pinned") -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype)
        self.counters.allocated(buf, pinned=True)
        return self._track(wrap_buffer(buf, SimPinnedTensor, SimRecord(name, "pinned", layer=self)))

    def free(self, buf: torch.Tensor) -> None:
        record = self.record_of(buf)
        if record is None:
            raise TypeError(f"sim device: free() of {type(buf).__name__} that this layer did not "
                            "allocate (alloc or pinned)")
        with self.lock:
            if record.freed:
                raise StreamOrderError(f"sim device: buffer '{record.name}' freed twice")
            if record.in_flight:
                raise StreamOrderError(
                    f"sim device: buffer '{record.name}' freed while {record.in_flight} copy(ies) "
                    "in flight still read or write it; wait their events first")
            if self.check_order:
                # A host action; device memory goes back to the default stream's pool.
                clock = VectorClock(self.host.clock)
                if record.kind == "device":
                    clock.merge(self.default.clock)
                check_access(record, clock, write=True, by="free")
            record.freed = True

    # -- streams and events -------------------------------------------------

    def stream(self, name: str) -> Stream:
        with self.lock:
            stream = SimStream(self, name, lane=DEFAULT_LANE + 1 + len(self._streams), worker=True)
            self._streams.append(stream)
        return stream

    def current_stream(self) -> Stream:
        return self.default

    def event(self) -> Event:
        return SimEvent(self)

    def synchronize(self) -> None:
        self.settle_compute()
        for stream in list(self._streams):
            stream.synchronize()
        with self.lock:
            self.host.clock.merge(self.default.clock)
        self.raise_worker_error()

    def raise_worker_error(self) -> None:
        if self.worker_errors:
            raise RuntimeError(f"sim device: a stream's work failed: {self.worker_errors[0]!r}") \
                from self.worker_errors[0]

    def close(self) -> None:
        if self.compute is not None:
            self.compute.stop()
        for stream in self._streams:
            stream.stop()
        self._streams.clear()

    # -- copies -------------------------------------------------------------

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> Event:
        with self._own_work():  # its time is bytes / gbps, and the poison is the sim's
            return self._copy(dst, src, stream)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None) -> Event:
        stream = stream or self.default
        assert isinstance(stream, SimStream), f"not a sim stream: {stream!r}"
        self.raise_worker_error()
        dst_record, src_record = self._record_for(dst), self._record_for(src)
        kinds = [r.kind if r is not None else "pageable" for r in (dst_record, src_record)]
        self._count_copy(dst, src, None if kinds[0] == kinds[1] else "up" if kinds[0] == "device"
                         else "down" if kinds[1] == "device" else None)
        if "device" not in kinds:
            raise TypeError("sim device: copy() between two host tensors; the layer copies to, "
                            "from or within the device")
        # Pageable host memory cannot be copied asynchronously: as on CUDA, the
        # caller waits for the copy (Note [device layer]).
        pageable = "pageable" in kinds
        with self.lock:
            index = len(self.schedule)
            stream.clock.merge(self.host.clock)  # what the host did before enqueueing is ordered before
            by = f"copy #{index} on stream '{stream.name}'"
            for record, write in ((src_record, False), (dst_record, True)):
                if record is not None and (record.freed or self.check_order):
                    check_access(record, stream.clock, write, by)
            seq = stream.next_seq()
            span = CopySpan(index, stream.name, src_record.name if src_record else "pageable host",
                            dst_record.name if dst_record else "pageable host", nbytes(src),
                            nbytes(src) / (self.gbps * 1e9) + self._rng.uniform(0.0, self.jitter_s))
            self.schedule.append(span)
            access = Access(stream.lane, seq, stream.name, f"copy #{index} ({span.src} -> {span.dst})")
            for record, write in ((src_record, False), (dst_record, True)):
                if record is not None:
                    note_access(record, access, write)
                    record.in_flight += 1
            dst_plain, src_plain = plain(dst), plain(src)
            poisoned = dst_record is None or dst_record.in_flight == 1  # nothing else still uses dst
            if poisoned and self.poison_memory:
                poison(dst_plain)

        def run() -> None:
            span.started = time.perf_counter()
            try:
                if not poisoned and self.poison_memory:
                    poison(dst_plain)
                time.sleep(span.modeled_s)
                dst_plain.copy_(src_plain)
            finally:
                span.finished = time.perf_counter()
                with self.lock:
                    for record in (src_record, dst_record):
                        if record is not None:
                            record.in_flight -= 1

        if stream.worker is None:
            run()
        else:
            stream.enqueue(run)
        done = SimEvent(self)
        done.record(stream)
        if pageable:
            done.synchronize()
        return done

    def _record_for(self, t: torch.Tensor) -> SimRecord | None:
        """The buffer's record; a tensor computed on the device gets one when a copy first touches it."""
        record = self.record_of(t)
        if record is None and isinstance(t, SimDeviceTensor):
            record = t._sim_record = SimRecord("computed device tensor", "device", layer=self)
        return record

    # -- buffers by address ---------------------------------------------------

    def _track(self, buf: torch.Tensor) -> torch.Tensor:
        """Remembers where `buf` lies, so a plain view of it (one taken with tensor
        subclasses off, as the engine's own code does) still finds its record."""
        with torch._C.DisableTorchFunctionSubclass():
            base = buf.untyped_storage().data_ptr()
            start = buf.data_ptr()
            end = start + buf.numel() * buf.element_size()
        with self.lock:
            self._tracked += 1
            if self._tracked % 1024 == 0:  # forget storages whose buffers are all gone
                self._by_storage = {k: v for k, v in self._by_storage.items()
                                    if any(sp[2]() is not None for sp in v)}
            spans = self._by_storage.setdefault(base, [])
            spans[:] = [sp for sp in spans if sp[2]() is not None]  # gone: their memory may be reused
            spans.append((start, end, weakref.ref(buf), record_of(buf)))
        return buf

    def record_of(self, t: torch.Tensor) -> SimRecord | None:
        """The record of `t`'s buffer: its own, or that of a live buffer it views."""
        record = record_of(t)
        if record is not None:
            return record
        with torch._C.DisableTorchFunctionSubclass():
            base, ptr = t.untyped_storage().data_ptr(), t.data_ptr()
        for start, end, alive, rec in list(self._by_storage.get(base, ())):
            if start <= ptr < end and alive() is not None:
                return rec
        return None

    # -- compute the layer cannot see (Note [compute the layer cannot see]) ----

    def lend(self, buf: torch.Tensor, *, write: bool) -> torch.Tensor:
        record = self.record_of(buf)
        if record is None:
            raise TypeError(f"sim device: lend() of {type(buf).__name__}; expected a buffer of this "
                            "layer (alloc, pinned, register_pinned or adopt)")
        self._compute_access("lend", record.kind == "device", [(record, write)])
        return plain(buf)

    def register_pinned(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        if isinstance(buf, SimTensor):
            raise TypeError(f"sim device: register_pinned() of {buf!r}, already the layer's")
        self.counters.allocated(buf, pinned=True)
        return self._track(wrap_buffer(buf, SimPinnedTensor, SimRecord(name, "pinned", layer=self)))

    def pinned_piece(self, piece: torch.Tensor, name: str) -> torch.Tensor:
        if isinstance(piece, SimTensor):
            raise TypeError(f"sim device: pinned_piece() of {piece!r}, already the layer's")
        return self._track(wrap_buffer(piece, SimPinnedTensor, SimRecord(name, "pinned", layer=self)))

    def adopt(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if isinstance(t, SimTensor):
            raise TypeError(f"sim device: adopt() of {t!r}, already the layer's")
        with self.lock:
            lane = self.default
            lane.clock.merge(self.host.clock)
            access = Access(lane.lane, lane.next_seq(), lane.name, f"compute (wrote '{name}')")
        return self._track(wrap_buffer(t, SimDeviceTensor, SimRecord(name, "device", last_write=access, layer=self)))

    # -- compute (called from SimTensor.__torch_function__) -------------------

    def _compute_access(self, op: str, on_device: bool, operands: list[tuple[torch.Tensor, bool]]) -> Access:
        """Device compute runs on the default stream; compute on pinned buffers is the host's."""
        with self.lock:
            lane = self.default if on_device else self.host
            if on_device:
                lane.clock.merge(self.host.clock)
            seq = lane.next_seq()
            access = Access(lane.lane, seq, lane.name, f"compute ({op})")
            where = "the default stream" if on_device else "the host"
            operands = [(t if isinstance(t, SimRecord) else record_of(t), write) for t, write in operands]
            for record, write in operands:
                if record.freed or self.check_order:
                    check_access(record, lane.clock, write, f"compute ({op}) on {where}")
            for record, write in operands:
                note_access(record, access, write)
            return access
