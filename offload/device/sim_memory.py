"""The simulated device's memory: tagged tensors and the stream-order check.

# Note [sim stream order]
The simulator must catch a missing wait every time, not only when jitter
happens to expose it, so beside the poison pattern (which shows a read of an
unfinished copy as NaN) it checks each access against the order the program
set up, as PyTorch's CUDA stream sanitizer does:

- Each stream is a lane of a vector clock, and so are the host threads
  (lane 0; the default stream is lane 1). Enqueueing an access on a stream
  advances its own lane, after merging the host's clock: what the host did
  before it enqueued is ordered before. `Event.record(s)` captures s's
  clock; `s.wait_event(e)` merges e's clock into s's; `Event.synchronize`,
  `Stream.synchronize` and the layer's `synchronize` merge into the host's.
  As on CUDA, the default stream waiting an event orders device compute, not
  the host's reads of a pinned buffer (the sim blocks the caller all the
  same, since it runs the default stream). Compute on device tensors is the
  default stream's; compute on pinned tensors is the host's.
- Device memory comes from the default stream's pool, as from CUDA's caching
  allocator: it may be memory that compute queued so far still uses, so a
  buffer from `alloc` starts as written by the default stream where it was
  allocated, and a side stream's first access must be ordered after that
  (`wait_stream(default)`, as FSDP2's copy-in does).
- Every buffer (`SimRecord`) keeps its last write and, per lane, its last
  read since. A write on stream t is legal when the last write and every
  read since are ordered before t (t's clock has reached them); a read when
  the last write is; a free when everything is. Otherwise
  `StreamOrderError`, naming the buffer, the stream and the access it races.

Copies are checked when enqueued (what CUDA orders is fixed at enqueue);
compute on device and pinned tensors is checked by `__torch_function__` when
it runs. Views share their base's record. A tensor computed on the device is
unnamed and untracked until a copy touches it.

Device memory (`SimDeviceTensor`) and pinned host memory (`SimPinnedTensor`)
are CPU tensors of their own classes: an op that mixes a device tensor with a
host tensor (other than a 0-dim one, as CUDA allows) raises, and so does
`.cpu()`, `.numpy()` or `.to(device)` on a device tensor: host<->device goes
through `DeviceLayer.copy`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

HOST_LANE = 0  # the host threads: their accesses are ordered before what they enqueue later
DEFAULT_LANE = 1
POISON_BYTE = 0xA5


class StreamOrderError(RuntimeError):
    """An access not ordered after a copy (or a copy not ordered after an access) it races."""


class HostDeviceMixError(RuntimeError):
    """Device memory used with host memory without a copy. Not a TypeError: torch turns a
    TypeError in a binary operator into NotImplemented, which would hide the message."""


@dataclass(frozen=True)
class Access:
    lane: int
    seq: int
    stream: str
    what: str  # "copy #3 (h2d)", "compute (add_)", ...


@dataclass
class SimRecord:
    """One buffer the layer handed out (or a computed tensor a copy touched)."""

    name: str
    kind: str  # "device" or "pinned"
    last_write: Access | None = None
    reads: dict[int, Access] = field(default_factory=dict)  # lane -> last read since the write
    in_flight: int = 0  # enqueued copies touching it that have not completed
    freed: bool = False
    layer: object = field(default=None, repr=False)  # the SimDevice that checks its accesses


class VectorClock(dict):
    """lane -> the last sequence number of that lane known to be ordered before."""

    def reached(self, access: Access) -> bool:
        return self.get(access.lane, 0) >= access.seq

    def merge(self, other: dict) -> None:
        for lane, seq in other.items():
            if self.get(lane, 0) < seq:
                self[lane] = seq


def _race(record: SimRecord, verb: str, by: str, other: Access) -> StreamOrderError:
    return StreamOrderError(
        f"sim device: buffer '{record.name}' {verb} by {by} while {other.what} on stream "
        f"'{other.stream}' is not ordered before it; wait that stream's event first "
        "(Stream.wait_event, Event.synchronize or synchronize); see Note [sim stream order]")


def check_access(record: SimRecord, clock: VectorClock, write: bool, by: str) -> None:
    """Raise unless the access `by` (with `clock`) is ordered after the accesses it conflicts with."""
    if record.freed:
        raise StreamOrderError(f"sim device: buffer '{record.name}' used by {by} after it was freed")
    if record.last_write is not None and not clock.reached(record.last_write):
        raise _race(record, "written" if write else "read", by, record.last_write)
    if write:
        for read in record.reads.values():
            if not clock.reached(read):
                raise _race(record, "written", by, read)


def note_access(record: SimRecord, access: Access, write: bool) -> None:
    if write:
        record.last_write = access
        record.reads.clear()
    else:
        record.reads[access.lane] = access


def poison(t: torch.Tensor) -> None:
    """Fill `t` (a plain tensor) with the pattern an unfinished copy leaves."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.view(torch.uint8).fill_(POISON_BYTE)


def plain(t: torch.Tensor) -> torch.Tensor:
    """An alias of `t` that no `__torch_function__` intercepts (for the layer's own work)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def record_of(t: torch.Tensor) -> SimRecord | None:
    return getattr(t, "_sim_record", None)


# Metadata reads: no data is touched, so neither the order nor the side matters.
_NO_ACCESS = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "nelement", "stride", "is_contiguous",
    "element_size", "data_ptr", "untyped_storage", "storage_offset", "is_floating_point",
    "is_complex", "__len__", "__hash__", "__repr__", "__format__", "_is_view", "requires_grad_",
})
_LEAVES_DEVICE = frozenset({"cpu", "numpy", "cuda", "__array__", "to"})


def _writes_first_argument(name: str) -> bool:
    """In-place ops (`add_`, `copy_`, `__iadd__`, `__setitem__`) write their first argument."""
    return (name.endswith("_") and not name.startswith("__")) or name == "__setitem__" \
        or name.startswith("__i")


class SimTensor(torch.Tensor):
    """A tensor of the simulated device's memory or its pinned host memory (Note [sim stream order])."""

    side = "?"

    def __repr__(self) -> str:
        record = record_of(self)
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(self.shape), self.dtype
        return f"{type(self).__name__}({record.name if record else 'computed'}, {shape}, {dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _NO_ACCESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        device_operand = next((t for t in tensors if isinstance(t, SimDeviceTensor)), None)
        if device_operand is not None:
            _refuse_host_mix(name, device_operand, tensors, flat)
        layer = next((r.layer for t in tensors if (r := record_of(t)) is not None), None)
        access = None
        if layer is not None:
            out_kw = kwargs.get("out")
            writes = {id(args[0])} if args and _writes_first_argument(name) else set()
            if out_kw is not None:
                writes.update(id(t) for t in tree_flatten(out_kw)[0] if isinstance(t, torch.Tensor))
            access = layer._compute_access(name, device_operand is not None, [(t, id(t) in writes) for t in tensors if record_of(t)])
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return _rewrap(out, tensors, device_operand is not None, layer, access)


class SimDeviceTensor(SimTensor):
    side = "device"


class SimPinnedTensor(SimTensor):
    side = "pinned host"


def _refuse_host_mix(name: str, device_t: torch.Tensor, tensors: list, flat: list) -> None:
    dev_name = record_of(device_t).name if record_of(device_t) else "a computed device tensor"
    if name in _LEAVES_DEVICE and (name != "to" or any(
            isinstance(a, (str, torch.device)) for a in flat)):
        raise HostDeviceMixError(f"sim device: {name}() on device buffer '{dev_name}': device memory "
                        "reaches the host only through DeviceLayer.copy")
    for t in tensors:
        if not isinstance(t, SimDeviceTensor):
            with torch._C.DisableTorchFunctionSubclass():
                scalar = t.dim() == 0
            if not scalar:
                raise HostDeviceMixError(f"sim device: {name} mixes device buffer '{dev_name}' with a host "
                                "tensor; copy it to the device with DeviceLayer.copy first")


def _rewrap(out, inputs: list, on_device: bool, layer, access: Access | None):
    """Outputs aliasing a tracked input keep its class and record; fresh outputs are
    device tensors when computed on the device (written by `access`, so a copy
    that reads one must be ordered after it), plain host tensors otherwise."""
    with torch._C.DisableTorchFunctionSubclass():
        by_storage = {t.untyped_storage().data_ptr(): t for t in inputs if isinstance(t, SimTensor)}

    def wrap(x):
        if not isinstance(x, torch.Tensor) or isinstance(x, SimTensor):
            return x
        with torch._C.DisableTorchFunctionSubclass():
            base = by_storage.get(x.untyped_storage().data_ptr())
            if base is not None:
                y = x.as_subclass(type(base))
                if record_of(base) is not None:
                    y._sim_record = record_of(base)
                return y
            if not on_device:
                return x
            y = x.as_subclass(SimDeviceTensor)
        if layer is not None:
            y._sim_record = SimRecord("computed device tensor", "device", last_write=access, layer=layer)
        return y

    return tree_map(wrap, out)


def wrap_buffer(t: torch.Tensor, cls: type, record: SimRecord) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        out = t.as_subclass(cls)
    out._sim_record = record
    return out

