"""Saved activations in the memory account, and checkpoint inputs kept on the host.

Note [activation bytes]
The ParameterManager's saved-tensor hooks (partition/manager.py, `_pack` and
`_unpack`) hand every saved tensor that is not a parameter to the engine's
ActivationSaver. The saver wraps it in a `_Saved` holder and charges the
bytes of its *storage* to the device tier, once per storage however many
saved tensors view it (q, k and v are views of one qkv output: one charge).
Each holder's death (autograd frees a node's saved tensors after the node
runs, or when the graph is dropped) releases its reference; the last one
credits the storage. So the device tier reads "bytes kept alive for
backward", whatever the model does with its own references.

Note [credits owed by the garbage collector]
A holder's death is seen through a weakref whose callback is `list.append`
(C, no Python frame), and the credit is settled on the next charge or read
of the account (MemoryAccount.add_settler): every charge sees exactly what
an immediate credit would have left, so peaks and budgets are unchanged.
Why not a Python callback (weakref.finalize): autograd frees saved tensors
thousands of times a step, and a Ctrl-C whose KeyboardInterrupt is raised
inside a weakref callback is printed as "Exception ignored" and lost: the
run went on training (1 in ~25 Ctrl-Cs of examples/finetune.py).

Parameters are never charged here: an offloaded one is replaced by the
manager's record before it reaches the saver, and a device-home one is
already charged where it lives (Shard.adopt).

A checkpoint's inputs (activations/recompute.py) are saved through the same
hooks inside `checkpoint_inputs()`. With cpu_checkpointing they go to the
host tier instead: on a device with memory of its own (cuda, sim: the
engine has copy streams), a copy through the device layer into a pinned
pool (and a device copy, charged while it lives, when recomputation needs
it back): Note [pinned checkpoint inputs]; on a CPU-only host the device
tier already is host memory, so no copy: the storage is charged to the host
tier instead of the device tier. (Without copy streams on CUDA, an engine
with no parameter to take them from, a fresh pinned tensor per input.)

Note [pinned checkpoint inputs]
With cpu_checkpointing on a device with memory of its own (the engine's
ShardContext has copy streams, Note [copy streams] in
transfers/device_copies.py), a checkpoint input goes device->host on the
`d2h` stream when forward saves it, into a buffer of one pinned pool
(`PinnedInputs`, a BufferPool of varying sizes registered with the layer and
charged to `memory.pinned_budget`'s ledger), and back host->device on the
`h2d` stream into a buffer of `layer.alloc` when backward recomputes from it.
The inputs live from forward to backward, so the pool holds every
checkpoint input of a step; its buffers are made in the first step and
reused in every later one (a buffer serves an input of up to its size and
at least half of it): no pinned allocation after the first step, unless a
later step's inputs are larger.
Its bound: `memory.pinned_budget` when set (shared with the other pinned
pools: what they hold is not left for this one), else a quarter of the
host's physical memory (PINNED_INPUTS_SHARE), divided among the job's ranks
on the host (Note [the node's share] in offload/node.py). An input the pool cannot
hold (the bound reached, the pinned budget refusing, or larger than the
bound) goes to pageable host memory instead: the layer copies it
synchronously, correct and only not overlapped; never an error mid-step.

A buffer goes back to the pool when its holder dies (the node that saved it
ran its backward, or the graph was dropped unrun), seen through `_died` and
`_settle` (Note [credits owed by the garbage collector]); not at unpack:
backward with retain_graph unpacks an input again. It goes back at once,
its copies perhaps still running: the next copy into it is ordered after
them by stream order alone. That copy runs on the d2h stream after
input-d2h-after-compute; a buffer copied back was read by an h2d copy that
compute waited (compute-after-h2d) before it used the input, so the d2h
stream, waiting compute, is ordered after that read too; a buffer never
copied back was last written on the d2h stream itself. (A wait on the host
before the release was tried and removing it made no test fail: it was
redundant.) At close the copy streams are synchronized before the pool drops
its buffers.

Bytes (Note [activation bytes]): a pooled copy is not charged by the saver:
the pool charges the host tier (through the pinned ledger) for every buffer
it holds, in use or cached, and charging the copy too would count the same
bytes twice. A pageable copy is charged to the host tier while its holder
lives, as on a CPU-only host. The device copy unpack makes is charged to
the device tier while it lives.

The waits (WAITS; tests/activations/test_sim_checkpointing.py removes each alone
and the simulator raises at the racing access, naming the buffer):

  input-d2h-after-compute   the d2h stream waits the compute stream before it
                            copies an input compute just wrote (`to_host`);
  input-h2d-after-d2h       the h2d stream waits the event of the input's
                            device->host copy before copying it back
                            (`to_device`): a stream wait, so the host never
                            blocks for it.

The copy back also makes two waits of Note [copy streams] through
CopyStreams: h2d-after-compute (to_device) and compute-after-h2d (wait).
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass

import psutil
import torch

from offload.aio.buffer_pool import BufferPool
from offload.aio.memory import round_up
from offload.device import Event
from offload.accounting import MemoryAccount, TierBudgetError
from offload.tiers import Tier

# The saver of the engine whose forward (or recomputation) is running, for
# offload.checkpoint(); None outside an engine.
ACTIVE: contextvars.ContextVar["ActivationSaver | None"] = contextvars.ContextVar(
    "offload_active_activation_saver", default=None)


class _Saved:
    """One saved tensor (detached: a saved output keeping its own grad_fn
    would make a cycle that outlives a dropped graph)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _OnHost(_Saved):
    """A checkpoint input copied to host memory; unpack copies it back."""

    __slots__ = ("device",)

    def __init__(self, tensor: torch.Tensor, device: torch.device):
        super().__init__(tensor)
        self.device = device


class _Staged(_Saved):
    """A checkpoint input copied to host memory through the device layer (Note
    [pinned checkpoint inputs]); `tensor` is the flat host copy."""

    __slots__ = ("shape", "copy")

    def __init__(self, tensor: torch.Tensor, shape: torch.Size, copy: "_HostCopy"):
        super().__init__(tensor)
        self.shape = shape
        self.copy = copy


@dataclass
class _HostCopy:
    """A checkpoint input's host copy: its pinned buffer (None: pageable memory)
    and the event of the device->host copy into it."""

    buf: torch.Tensor | None
    written: Event


# The waits of Note [pinned checkpoint inputs], by name. Tests remove one at a time
# to show the simulator catches its absence; nothing else may.
WAITS = ("input-d2h-after-compute", "input-h2d-after-d2h")
removed_waits: set[str] = set()


def waits(name: str) -> bool:
    """Whether the wait `name` (one of WAITS) is made."""
    return name not in removed_waits


PINNED_INPUTS_SHARE = 0.25  # of physical host memory: the pool's bound without memory.pinned_budget


class PinnedInputs:
    """Checkpoint inputs device->host into pinned buffers and back (Note [pinned checkpoint inputs])."""

    def __init__(self, streams, ledger, *, pin: bool, local_ranks: int = 1):
        self.streams = streams
        self.layer = streams.layer
        # Without a pinned budget: this rank's share of the host's (Note [the node's share]).
        budget = ledger.budget if ledger is not None and ledger.budget is not None \
            else int(PINNED_INPUTS_SHARE * psutil.virtual_memory().total) // max(1, local_ranks)
        self.pool = BufferPool(max(budget, 8192), pin=pin, ledger=ledger, what="pinned checkpoint input",
                               register=self.layer.register_pinned)

    def to_host(self, src: torch.Tensor) -> _Staged:
        """Starts the copy of `src`, which compute wrote, to host memory."""
        flat = src.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        on_device = self.layer.adopt(flat, f"checkpoint input {tuple(src.shape)}")
        buf = self._acquire(nbytes)
        if buf is None:
            host = torch.empty(flat.shape, dtype=flat.dtype)
        else:  # a view, no access: the layer finds the buffer by address (its copies may still run)
            with torch._C.DisableTorchFunctionSubclass():
                host = buf.as_subclass(torch.Tensor)[:nbytes].view(flat.dtype)
        if waits("input-d2h-after-compute"):
            self.streams.d2h.wait_stream(self.streams.compute)
        try:  # pageable: the layer copies synchronously
            written = self.layer.copy(host, on_device, self.streams.d2h)
        except BaseException:
            if buf is not None:
                self.pool.release(buf)
            raise
        return _Staged(host, src.shape, _HostCopy(buf, written))

    def to_device(self, saved: _Staged) -> torch.Tensor:
        """The input back on the device, for compute on the current stream."""
        host = saved.tensor
        with torch._C.DisableTorchFunctionSubclass():
            numel, dtype = host.numel(), host.dtype
        out = self.layer.alloc(numel, dtype, f"checkpoint input {tuple(saved.shape)} (back)")
        if waits("input-h2d-after-d2h"):
            self.streams.h2d.wait_event(saved.copy.written)
        self.streams.wait(self.streams.to_device(out, host))
        return self.layer.lend(out, write=False).view(saved.shape)

    def returned(self, copy: _HostCopy) -> None:
        """Its holder died (any thread: Note [credits owed by the garbage collector]);
        its copies may still run (Note [pinned checkpoint inputs]: ordered by the streams)."""
        self.pool.release(copy.buf)

    def _acquire(self, nbytes: int) -> torch.Tensor | None:
        """A pinned buffer of at least nbytes, or None: the input goes to pageable memory."""
        if round_up(nbytes) > self.pool.budget_bytes:
            return None
        try:
            return self.pool.try_acquire(nbytes)
        except MemoryError:  # memory.pinned_budget (or the host tier) refused a new buffer
            return None

    def close(self) -> None:
        """The pool closed: its cached buffers and their charge go now, those of
        holders still alive when they die; no copy still uses them. Idempotent."""
        if self.pool.closed:
            return
        self.streams.d2h.synchronize()
        self.streams.h2d.synchronize()
        self.pool.close()


@dataclass
class _Charge:
    tier: Tier
    nbytes: int
    refs: int


class ActivationSaver:
    def __init__(self, account: MemoryAccount, device: torch.device, *,
                 cpu_checkpointing: bool = False, synchronize: bool = False, profile: bool = False):
        self.account = account
        self.manager = None  # the engine's ParameterManager, set by ActivationCheckpointing.attach
        self.device = device
        self.cpu_checkpointing = cpu_checkpointing
        self.synchronize = synchronize
        # The device layer's synchronize where the device runs apart from the host
        # (set by ActivationCheckpointing.attach); None: nothing to wait for.
        self.wait_for_device = None
        self.profile = profile
        self.timings = {"checkpointed_forward_s": 0.0, "recompute_s": 0.0,
                        "checkpointed_calls": 0, "recomputations": 0}
        self._lock = threading.RLock()  # account.charge under it settles (Note [credits owed by the garbage collector])
        self._charges: dict[tuple, _Charge] = {}  # storage key -> its charge
        # Note [credits owed by the garbage collector]: id(weakref) -> (weakref, storage key
        # or _HostCopy) for live holders; `_died` gets each weakref as its holder dies.
        self._watched: dict[int, tuple[weakref.ref, tuple | _HostCopy]] = {}
        self._died: list[weakref.ref] = []
        account.add_settler(self._settle)
        self._local = threading.local()  # .inputs: inside checkpoint_inputs(), "host" where they go there
        self.pinned_inputs: PinnedInputs | None = None  # use_copy_streams (Note [pinned checkpoint inputs])
        # Device-charged bytes now and their peak since reset_peak: read at every planned
        # block's call (Note [activations in the plan] in activations/plan.py), so kept
        # as a running sum rather than summed over the charges.
        self._device_now = 0
        self.device_peak = 0
        # The activation plan, told when backward starts (its first unpack); None: no plan.
        self.plan = None

    def use_copy_streams(self, streams, ledger, *, pin: bool, planned: bool = False, local_ranks: int = 1) -> None:
        """Checkpoint inputs go through the device layer's copy streams and a pinned
        pool (Note [pinned checkpoint inputs]); with cpu_checkpointing, or where the
        activation plan may send a block's inputs to the host (planned)."""
        if (self.cpu_checkpointing or planned) and self.pinned_inputs is None:
            self.pinned_inputs = PinnedInputs(streams, ledger, pin=pin, local_ranks=local_ranks)

    def close(self) -> None:
        """The pinned pool's buffers and their charge go (engine close). Idempotent."""
        if self.pinned_inputs is not None:
            self._settle()
            self.pinned_inputs.close()

    # ---- the manager's hook point (Note [activation bytes]) ---------------
    def pack(self, t: torch.Tensor):
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        inputs = getattr(self._local, "inputs", False)
        if inputs and (self.cpu_checkpointing or inputs == "host"):
            return self._pack_to_host(t)
        held = _Saved(t.detach() if t.requires_grad else t)
        self._acquire(held.tensor, Tier.DEVICE, held)
        return held

    def unpack(self, saved):
        if self.plan is not None and self.plan.awaits_backward:
            self.plan.backward_starts(self.device_bytes())
        if isinstance(saved, _Staged):
            back = self.pinned_inputs.to_device(saved)
            self._acquire(back, Tier.DEVICE, back.untyped_storage())
            return back
        if isinstance(saved, _OnHost):
            if saved.device.type == "cpu":
                return saved.tensor
            back = saved.tensor.to(saved.device, non_blocking=True)
            self._acquire(back, Tier.DEVICE, back.untyped_storage())
            return back
        if isinstance(saved, _Saved):
            return saved.tensor
        return saved

    @contextlib.contextmanager
    def checkpoint_inputs(self, to_host: bool = False):
        """Saves inside are a checkpoint's inputs (moved to host with cpu_checkpointing,
        or where to_host: the activation plan's choice for one block)."""
        self._local.inputs = "host" if to_host else True
        try:
            yield
        finally:
            self._local.inputs = False

    # ---- bytes ---------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes of saved activations now charged to the device tier."""
        self._settle()
        return self._device_now

    def reset_peak(self) -> None:
        """device_peak starts again from the bytes held now."""
        self._settle()
        with self._lock:
            self.device_peak = self._device_now

    def held_storages(self) -> int:
        self._settle()
        with self._lock:
            return len(self._charges)

    def _pack_to_host(self, t: torch.Tensor) -> _Saved:
        src = t.detach()
        if self.pinned_inputs is not None and src.numel():
            held = self.pinned_inputs.to_host(src)
            if held.copy.buf is None:  # pageable; a pooled copy is the pool's charge
                self._acquire(held.tensor, Tier.HOST, held)
            else:
                self._watch(held, held.copy)
            return held
        if src.device.type == "cpu":
            held = _OnHost(src, src.device)
        else:
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)
            held = _OnHost(host, src.device)
        self._acquire(held.tensor, Tier.HOST, held)
        return held

    def _acquire(self, t: torch.Tensor, tier: Tier, anchor) -> None:
        """Charges t's storage (first reference) until `anchor` dies."""
        # Outside the forward's TorchFunctionMode: Note [bookkeeping outside the
        # mode] in offload/partition/manager.py.
        with torch._C.DisableTorchFunction():
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:
                return
            key = (storage.device.type, storage.device.index, storage.data_ptr())
        self._settle()  # a dead storage's charge at this address goes first
        with self._lock:
            charge = self._charges.get(key)
            if charge is None:
                # Charged before it is recorded: a budget error leaves nothing behind.
                try:
                    self.account.charge(tier, nbytes, f"saved activation ({tuple(t.shape)}, {t.dtype})")
                except TierBudgetError as e:
                    if self.plan is None or tier is not Tier.DEVICE:
                        raise
                    raise TierBudgetError(f"{e}; {self.plan.short_of()}") from None
                charge = self._charges[key] = _Charge(tier, nbytes, 0)
                if tier is Tier.DEVICE:
                    self._device_now += nbytes
                    self.device_peak = max(self.device_peak, self._device_now)
            charge.refs += 1
            self._watch(anchor, key)

    def _watch(self, anchor, what) -> None:
        """At `anchor`'s death, `_settle` releases `what`: a storage key's reference,
        or a _HostCopy's pinned buffer (Note [pinned checkpoint inputs])."""
        with self._lock:
            ref = weakref.ref(anchor, self._died.append)
            self._watched[id(ref)] = (ref, what)

    def _settle(self) -> None:
        """Credits the storages whose last holder died since the last call."""
        while self._died:
            try:
                ref = self._died.pop()
            except IndexError:  # another thread settled it
                return
            with self._lock:
                _, what = self._watched.pop(id(ref))
            if isinstance(what, _HostCopy):
                self.pinned_inputs.returned(what)
            else:
                self._release(what)

    def _release(self, key: tuple) -> None:
        with self._lock:
            charge = self._charges[key]
            charge.refs -= 1
            if charge.refs:
                return
            del self._charges[key]
            if charge.tier is Tier.DEVICE:
                self._device_now -= charge.nbytes
        self.account.credit(charge.tier, charge.nbytes)

    @contextlib.contextmanager
    def active(self):
        token = ACTIVE.set(self)
        try:
            yield
        finally:
            ACTIVE.reset(token)
