"""The device layer's typed interface (Note [device layer]).

# Note [device layer]
Every device-tier allocation, host<->device copy, stream, event and pinned
host buffer goes through one `DeviceLayer`, in the spirit of FSDP2's `Comm`
and `OffloadPolicy` objects: the engine asks the layer, never `torch.cuda`
directly, so one engine runs on three implementations:

- `cuda` (device/cuda.py): torch.cuda streams and events, pinned host memory
  (`pin_memory=True`), and `record_stream` on every device tensor a side
  stream touches, so the caching allocator does not hand its memory out
  again before that stream is done with it.
- `sim` (device/sim.py): a simulated accelerator on CPU with real
  asynchrony, for tests. Device memory is a tensor subclass that refuses to
  mix with host tensors; each stream is a worker thread running its queue in
  order; a copy takes modeled time (bytes / bandwidth + seeded jitter) and its
  destination holds a poison pattern (NaN, or bytes 0xA5) until it completes;
  and every access is checked against the stream order (Note [sim stream
  order]): a missing wait raises, naming the buffer, whatever the timing.
- `cpu` (device/cpu.py): synchronous and trivial: what the engine did before
  this layer existed. The default where CUDA is absent.

Chosen by `offload.device.from_env()`: `OFFLOAD_DEVICE=cuda|sim|cpu`; unset
is cuda where CUDA exists, else cpu, never sim. `offload report` names it.

The contract the engine programs against, the same for all three:
- `alloc(numel, dtype, name)` gives a device tensor; `free(buf)` says the
  caller is done with it (the sim refuses while a copy not ordered before
  the caller still uses it). `pinned(numel, dtype, name)` gives a host
  staging buffer. Counters (`DeviceCounters`) count each, so "no pinned
  allocation after the first step" can be asserted.
- `copy(dst, src, stream)` enqueues dst <- src on `stream` and returns an
  `Event` recorded after it. Nothing may read `dst`, or write either, until
  the reader's stream has waited that event (`Stream.wait_event`,
  `Event.synchronize`, `Stream.wait_stream`, `synchronize`).
- Compute runs on the current (default) stream; on the sim that is the
  calling thread, so the default stream waiting an event blocks the caller.
  That orders later device compute, not the host's reads of a pinned buffer
  a copy writes: those need `Event.synchronize` (or a stream's, or the
  layer's `synchronize`), as on CUDA.
- Note [compute the layer cannot see]: the model's ops and the collectives
  run on plain tensors, so the engine tells the layer where compute takes a
  device buffer (`lend`, the hand-over of a gathered parameter to the model
  or to a collective) and where compute gives one (`adopt`, autograd's
  gradient before its copy to the host). On cuda and cpu both return their
  argument; the sim checks and records the access there, as compute on the
  default stream, so a wait missing before a hand-over raises.
- The sim counts all host threads as one (it cannot see a hand-over
  between two host threads, so a wait on one counts for all).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass
class DeviceCounters:
    """What went through a layer, counted by the layer itself."""

    device_allocations: int = 0
    device_bytes_allocated: int = 0
    pinned_allocations: int = 0
    pinned_bytes_allocated: int = 0  # cumulative
    copies: int = 0
    bytes_copied: int = 0  # every copy, whichever way
    bytes_to_device: int = 0  # host -> device: up the bus
    bytes_to_host: int = 0  # device -> host: down the bus

    def allocated(self, buf: torch.Tensor, *, pinned: bool = False) -> torch.Tensor:
        """Counts an allocation (device memory, or pinned host memory); returns buf."""
        if pinned:
            self.pinned_allocations += 1
            self.pinned_bytes_allocated += nbytes(buf)
        else:
            self.device_allocations += 1
            self.device_bytes_allocated += nbytes(buf)
        return buf


class Event(abc.ABC):
    """Marks a point in a stream; completes when the stream's work before it has."""

    @abc.abstractmethod
    def record(self, stream: "Stream") -> None: ...

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the work before the record has completed (or it was never recorded)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling host thread until the event has completed."""


class Stream(abc.ABC):
    """An in-order queue of device work."""

    name: str

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Later work on this stream starts after `event` completes."""

    @abc.abstractmethod
    def wait_stream(self, other: "Stream") -> None:
        """Later work on this stream starts after the work already queued on `other`."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling host thread until this stream's queued work has completed."""


class DeviceLayer(abc.ABC):
    """Allocations, copies, streams, events and pinned buffers (Note [device layer])."""

    name: str
    device: torch.device  # where compute runs

    def __init__(self) -> None:
        self.counters = DeviceCounters()

    @abc.abstractmethod
    def alloc(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        """An uninitialised 1-D device tensor; `name` appears in the layer's errors."""

    @abc.abstractmethod
    def free(self, buf: torch.Tensor) -> None:
        """The caller is done with `buf` (device or pinned)."""

    @abc.abstractmethod
    def pinned(self, numel: int, dtype: torch.dtype, name: str = "pinned") -> torch.Tensor:
        """An uninitialised 1-D host staging buffer, page-locked where the device has such a thing."""

    @abc.abstractmethod
    def stream(self, name: str) -> Stream:
        """A new side stream."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream compute runs on."""

    @abc.abstractmethod
    def event(self) -> Event: ...

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> Event:
        """Enqueue dst <- src on `stream` (the current stream if None); the event completes with it."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until every stream's queued work has completed."""

    # What the layer can do, asked instead of its name (Note [one device choice]).
    separate_memory = True  # False only where the device is the host (cpu)
    # Whether host buffers that feed the device are page-locked (pin_memory):
    # only cuda. The sim tracks the same buffers as pinned without locking them
    # (there is no CUDA to lock them with), so it takes cuda's paths all the same.
    page_locks = False

    # Compute the layer does not run itself (Note [compute the layer cannot see]).

    def lend(self, buf: torch.Tensor, *, write: bool) -> torch.Tensor:
        """A plain alias of `buf` for compute the layer cannot see: on a device buffer,
        compute on the current stream (the model's ops, a collective); on a pinned
        buffer, the host's (an NVMe read into it, the optimizer reading it). The
        access is checked now."""
        return buf

    def register_pinned(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        """Host memory the caller allocated (page-locked where the device pins:
        offload.aio.memory.aligned_empty) as a pinned buffer of this layer, counted
        as a pinned allocation; returns the buffer to use from now on."""
        return self.counters.allocated(buf, pinned=True)

    def pinned_piece(self, piece: torch.Tensor, name: str) -> torch.Tensor:
        """A piece of a buffer registered with register_pinned, lent to one copy at a
        time (the gradient staging ring): tracked on its own where the layer tracks
        buffers (the sim), so copies into other pieces are not its."""
        return piece

    def adopt(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """`t`, which compute on the current stream wrote (autograd's gradient), as a device
        buffer the layer can copy from; its write counts as the current stream's, now."""
        return t

    def describe(self) -> str:
        return self.name

    def free_memory(self) -> int | None:
        """Bytes of device memory free now, where the layer can tell (an auto
        placement's default device budget: Note [automatic placement]); None else."""
        return None

    def close(self) -> None:
        """Release what the layer holds (the sim's worker threads)."""

    def _count_copy(self, dst: torch.Tensor, src: torch.Tensor, way: str | None = None) -> None:
        """Counts a copy; `way` is "up" (host -> device), "down" (device -> host) or
        None (within one side: the cpu layer's copies, device -> device)."""
        check_copy_shapes(dst, src)
        self.counters.copies += 1
        self.counters.bytes_copied += nbytes(src)
        if way == "up":
            self.counters.bytes_to_device += nbytes(src)
        elif way == "down":
            self.counters.bytes_to_host += nbytes(src)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_copy_shapes(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"device copy: destination {tuple(dst.shape)} {dst.dtype} and source "
                             f"{tuple(src.shape)} {src.dtype} differ; a layer copy moves bytes, it "
                             "neither reshapes nor converts")
