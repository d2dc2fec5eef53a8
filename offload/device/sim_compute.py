"""The sim device's compute time: device ops take a modeled time (Note [sim modeled compute]).

# Note [sim modeled compute]
On the sim the compute (default) stream is the calling thread, so the model's
ops run on the same host cores the engine's host-side work needs (the
overlapped CPU Adam, the copy workers). Beside a GPU those cores are free
while a kernel runs; on the plain sim they are busy, so it cannot show how
much optimizer and copy time a GPU's compute would hide. With a rate set
(`ComputeRate`: `SimDevice(compute=...)`, or OFFLOAD_SIM_TFLOPS and
OFFLOAD_SIM_DEVICE_GBPS through `from_env()`), each aten op on device memory
takes a modeled time instead:

    modeled = max(flops / (tflops * 1e12), bytes / (device_gbps * 1e9))

- The op still runs, unchanged (results are bit for bit those without the
  model); the thread then *sleeps* max(0, modeled - the op's real time).
  Sleeping releases the GIL and the core, as a GPU leaves the host free
  while its kernel runs; a busy wait would take the very cores the model is
  meant to give back. Where the host is slower than the model the real time
  stands (nothing sleeps): the model holds only for ops the host runs faster.
- FLOPs come from torch.utils.flop_counter's formulas (mm, addmm, bmm,
  baddbmm, convolution and its backward, the SDPA kernels), plus its SDPA
  formulas for the CPU flash kernel that SDPA picks here. Autograd's
  backward ops go through the same table, so a linear layer's backward costs
  twice its forward. `bytes` is every tensor operand plus every output (an
  in-place op reads and writes its first argument); device_gbps = 0 leaves
  that term out, so memory-bound ops (elementwise, reductions, copies within
  the device) then take their host time only.
- Device memory is what the stream-order check calls the device's: a
  `SimDeviceTensor`, a plain alias of one of the layer's device buffers (the
  engine's `lend`: the model's parameters), and any storage a device op
  wrote (activations, gradients; kept by storage, so views and autograd's
  saved tensors stay device memory). Host and pinned tensors are the host's:
  the optimizer, and ops on the model's host inputs alone, are not modeled.
- Which ops: those dispatched on the thread that built the layer (the
  engine's compute thread) and on threads that inherit its dispatch state
  (autograd's): a `TorchDispatchMode` entered when the layer is built and
  left at `close()`. A composite op that reaches it whole (linear under
  inference_mode) is decomposed first, as FlopCounterMode does, but only
  where the host would run that composite anyway: decomposing one that has
  a CPU kernel of its own (silu_backward) would change its rounding. The
  layer's own work on that thread (a copy, whose time its bandwidth models
  already, and the poison it writes) is not compute.
- When it sleeps: as a GPU runs kernels while its host queues more, each op
  is placed on a modeled device timeline: it starts when the device is free
  or when the host issued it, whichever is later, and lasts its modeled time
  (the host's own run of the op counts as the time spent issuing it). The
  host sleeps until the device is done only where it synchronizes with it
  (the layer's synchronize, an event's synchronize) and when it runs more
  than QUEUE_S ahead (a launch queue's depth). An event recorded on the
  default stream completes when the modeled device reaches it: a copy stream
  that waits it starts no sooner (SimEvent.ready_at). When the default
  stream waits a copy still running, the modeled device idles until it lands. So the host's own work between ops
  (hooks, Python, this mode's dispatch) hides under the modeled kernels, as
  it does on a GPU. Only the building thread sleeps.
- `SimDevice.modeled_compute_s` is the modeled time summed over ops, reset
  by `reset_modeled_compute()`; `compute.counters` also keeps ops, FLOPs,
  bytes and the time slept. A step's wall time against it shows what the
  host side added.
Not modeled: kernel launch latency; per-dtype rates (one rate for every
dtype, no tensor-core speedup for bf16); the FLOPs of elementwise ops (their
bytes only, when device_gbps is set); ops without a device operand (a factory
such as torch.zeros inside the model) and ops on other threads; collectives'
time; caches, kernel concurrency, and a host slower than the model. Nor the
host's work that a GPU would not need: the sim's own copies and poison run on
host threads and cores, so on a small host a step errs long against the
modeled GPU.
While the layer is open its mode is on the building thread's dispatch
stack: a mode entered before the layer was built and left before its close
would pop it instead of its own (TorchDispatchMode pops the top); a layer
never closed leaves it there, idle (it passes every op through); and
torch.compile sees a dispatch mode.
"""
from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from offload.device.sim_memory import SimDeviceTensor, record_of

QUEUE_S = 0.25  # how far the host may run ahead of the modeled device before it waits

_aten = torch.ops.aten
# torch's formulas, by overload packet, and the CPU flash SDPA kernels that SDPA picks on
# the host (their arguments begin as the fused kernels' do: q, k, v; grad_out, q, k, v).
FLOP_FORMULAS = {
    **flop_counter.flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop,
}


@dataclass(frozen=True, kw_only=True)
class ComputeRate:
    """The modeled device's speed. `tflops` 0: compute is not modeled (the sim's default);
    `device_gbps` 0: memory-bound ops are not modeled (only FLOPs are)."""

    tflops: float = 0.0
    device_gbps: float = 0.0

    def __post_init__(self) -> None:
        for key, value in (("tflops", self.tflops), ("device_gbps", self.device_gbps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"sim compute: {key}={value!r}; expected a finite number >= 0 "
                                 "(0: not modeled)")
        if self.device_gbps and not self.tflops:
            raise ValueError(f"sim compute: device_gbps={self.device_gbps!r} "
                             "(OFFLOAD_SIM_DEVICE_GBPS) without tflops (OFFLOAD_SIM_TFLOPS); "
                             "set tflops > 0 to model compute")

    @property
    def modeled(self) -> bool:
        return self.tflops > 0

    def seconds(self, flops: int, nbytes: int) -> float:
        """The modeled time of one op: compute-bound or memory-bound, whichever is longer."""
        compute = flops / (self.tflops * 1e12)
        memory = nbytes / (self.device_gbps * 1e9) if self.device_gbps else 0.0
        return max(compute, memory)

    def describe(self) -> str:
        memory = f", device memory {self.device_gbps:g} GB/s" if self.device_gbps else ""
        return f"compute modeled at {self.tflops:g} TFLOP/s{memory}"


@dataclass
class ComputeCounters:
    """What the compute model timed since the layer was built or last reset."""

    ops: int = 0  # device ops timed
    flops: int = 0
    bytes: int = 0
    modeled_s: float = 0.0  # the sum of the ops' modeled times
    slept_s: float = 0.0  # what the compute thread slept (the part the host did not spend)


class ComputeClock:
    """The sim's compute stream in time: times device ops and sleeps their excess
    (Note [sim modeled compute]). Built by a `SimDevice`, on the thread that computes."""

    def __init__(self, layer, rate: ComputeRate) -> None:
        if not rate.modeled:
            raise ValueError("sim compute: a clock needs a rate with tflops > 0")
        self.rate = rate
        self.counters = ComputeCounters()
        self._layer = weakref.ref(layer)  # weak: a mode left on a stack keeps no layer alive
        self._computed: weakref.WeakSet = weakref.WeakSet()  # storages device ops wrote
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.perf_counter() when the modeled device has run what was queued
        self._paused = threading.local()
        self._owner = threading.get_ident()
        self._decomposes: dict = {}
        self._mode: _ComputeMode | None = _ComputeMode(self)
        self._mode.__enter__()

    # -- the layer's side ---------------------------------------------------

    @property
    def active(self) -> bool:
        return self._mode is not None and not getattr(self._paused, "depth", 0)

    @contextmanager
    def unmodeled(self):
        """The layer's own work on the compute thread (a copy, the poison): not compute."""
        self._paused.depth = getattr(self._paused, "depth", 0) + 1
        try:
            yield
        finally:
            self._paused.depth -= 1

    @property
    def free_at(self) -> float:
        return self._free_at

    def advance_to(self, when: float) -> None:
        with self._lock:
            self._free_at = max(self._free_at, when)

    def settle(self) -> None:
        """Sleep the debt: the compute queued so far has run (on the building thread only)."""
        self._wait_until(self._free_at)

    def _wait_until(self, when: float) -> None:
        if threading.get_ident() != self._owner:
            return
        start = time.perf_counter()
        if when <= start:
            return
        time.sleep(when - start)
        with self._lock:
            self.counters.slept_s += time.perf_counter() - start

    def reset(self) -> ComputeCounters:
        """The counters so far; counting starts again from zero."""
        with self._lock:
            counters, self.counters = self.counters, ComputeCounters()
        return counters

    def stop(self) -> None:
        """Leave the building thread's dispatch stack (from the layer's close)."""
        mode, self._mode = self._mode, None
        if mode is not None and threading.get_ident() == self._owner \
                and _get_current_dispatch_mode() is mode:
            mode.__exit__(None, None, None)
        # Else another mode is above it, or this is another thread: it stays, passing
        # every op through untimed, until that thread's stack unwinds past it.

    # -- the mode's side ----------------------------------------------------

    def on_device(self, tensors: list[torch.Tensor]) -> bool:
        layer = self._layer()
        if layer is None:
            return False
        with torch._C.DisableTorchFunctionSubclass():
            for t in tensors:
                storage = _storage(t)
                if storage is not None and storage in self._computed:
                    return True
                record = layer.record_of(t) if storage is not None else record_of(t)
                if record is not None:
                    if record.kind == "device" and record.layer is layer:
                        return True
                elif isinstance(t, SimDeviceTensor):
                    return True
        return False

    def wrote(self, out) -> None:
        """The outputs of a device op are device memory (unless they are the layer's host buffers)."""
        layer = self._layer()
        with torch._C.DisableTorchFunctionSubclass():
            for t in _tensors(out):
                if (storage := _storage(t)) is not None \
                        and storage not in self._computed:
                    record = layer.record_of(t) if layer is not None else None
                    if record is None or record.kind == "device":
                        self._computed.add(storage)

    def decomposes(self, func) -> bool:
        """Whether `func` would run its composite (math) kernel here, so that running its parts
        instead computes the same bits. Not where a kernel of its own would run: silu_backward
        has a CPU kernel beside the composite one used for double backward, with other rounding."""
        known = self._decomposes.get(func)
        if known is None:
            has = functools.partial(torch._C._dispatch_has_kernel_for_dispatch_key, func.name())
            keys = torch._C.DispatchKey
            known = self._decomposes[func] = func.overloadpacket not in FLOP_FORMULAS \
                and has(keys.CompositeImplicitAutograd) and not any(
                    has(k) for k in (keys.CPU, keys.CompositeExplicitAutograd,
                                     keys.CompositeExplicitAutogradNonFunctional))
        return known

    def spend(self, func, args, kwargs, out, start: float, elapsed: float) -> None:
        formula = FLOP_FORMULAS.get(func.overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        nbytes = 0
        if self.rate.device_gbps:
            outputs = _tensors(out)
            if outputs:  # an op that returns no tensor (item, equal) moves next to nothing
                nbytes = sum(map(_nbytes, _tensors(args, kwargs.values()))) + sum(map(_nbytes, outputs))
        modeled = self.rate.seconds(flops, nbytes)
        with self._lock:
            c = self.counters
            c.ops += 1
            c.flops += flops
            c.bytes += nbytes
            c.modeled_s += modeled
            # On the device from when the host issued it (or the device came free),
            # for the longer of its modeled time and the host's run of it.
            self._free_at = max(self._free_at, start) + max(modeled, elapsed)
            ahead = self._free_at - time.perf_counter()
        if ahead > QUEUE_S:  # the launch queue is full: the host waits for room
            self._wait_until(self._free_at - QUEUE_S)


class _ComputeMode(TorchDispatchMode):
    """Times the device ops dispatched while it is on the stack (Note [sim modeled compute])."""

    def __init__(self, clock: ComputeClock) -> None:
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        clock = self.clock
        if func.is_view or not clock.active:
            return func(*args, **kwargs)  # a view moves no bytes; its storage says where it lies
        if not clock.on_device(_tensors(args, kwargs.values())):
            return func(*args, **kwargs)
        if clock.decomposes(func):  # a composite that reached us whole: time its parts
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        clock.wrote(out)
        clock.spend(func, args, kwargs, out, start, elapsed)
        return out


def _tensors(*groups) -> list[torch.Tensor]:
    """The tensors among aten arguments or results: given, or in a list (cat's); a
    pytree walk per op would cost more than most of the small ops it times."""
    found = []
    for group in groups:
        if isinstance(group, torch.Tensor):
            found.append(group)
            continue
        if not isinstance(group, (list, tuple, type({}.values()))):
            continue  # a scalar result (equal, item)
        for x in group:
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif isinstance(x, (list, tuple)):
                found.extend(y for y in x if isinstance(y, torch.Tensor))
    return found


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
