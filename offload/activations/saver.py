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
host tier instead: with CUDA, a copy into pinned host memory (and a device
copy, charged while it lives, when recomputation needs it back); on a
CPU-only host the device tier already is host memory, so no copy: the
storage is charged to the host tier instead of the device tier.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from dataclasses import dataclass

import torch

from offload.partition.accounting import MemoryAccount
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
        self.synchronize = synchronize and device.type == "cuda"
        self.profile = profile
        self.timings = {"checkpointed_forward_s": 0.0, "recompute_s": 0.0,
                        "checkpointed_calls": 0, "recomputations": 0}
        self._lock = threading.RLock()  # account.charge under it settles (Note [credits owed ...])
        self._charges: dict[tuple, _Charge] = {}  # storage key -> its charge
        # Note [credits owed by the garbage collector]: id(weakref) -> (weakref, storage key)
        # for live holders; `_died` gets each weakref as its holder dies.
        self._watched: dict[int, tuple[weakref.ref, tuple]] = {}
        self._died: list[weakref.ref] = []
        account.add_settler(self._settle)
        self._local = threading.local()  # .inputs: inside checkpoint_inputs()

    # ---- the manager's hook point (Note [activation bytes]) ---------------
    def pack(self, t: torch.Tensor):
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        if getattr(self._local, "inputs", False) and self.cpu_checkpointing:
            return self._pack_to_host(t)
        held = _Saved(t.detach() if t.requires_grad else t)
        self._acquire(held.tensor, Tier.DEVICE, held)
        return held

    def unpack(self, saved):
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
    def checkpoint_inputs(self):
        """Saves inside are a checkpoint's inputs (moved to host with cpu_checkpointing)."""
        self._local.inputs = True
        try:
            yield
        finally:
            self._local.inputs = False

    # ---- bytes ---------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes of saved activations now charged to the device tier."""
        self._settle()
        with self._lock:
            return sum(c.nbytes for c in self._charges.values() if c.tier is Tier.DEVICE)

    def held_storages(self) -> int:
        self._settle()
        with self._lock:
            return len(self._charges)

    def _pack_to_host(self, t: torch.Tensor) -> _OnHost:
        src = t.detach()
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
                self.account.charge(tier, nbytes, f"saved activation ({tuple(t.shape)}, {t.dtype})")
                charge = self._charges[key] = _Charge(tier, nbytes, 0)
            charge.refs += 1
            ref = weakref.ref(anchor, self._died.append)
            self._watched[id(ref)] = (ref, key)

    def _settle(self) -> None:
        """Credits the storages whose last holder died since the last call."""
        while self._died:
            try:
                ref = self._died.pop()
            except IndexError:  # another thread settled it
                return
            with self._lock:
                _, key = self._watched.pop(id(ref))
            self._release(key)

    def _release(self, key: tuple) -> None:
        with self._lock:
            charge = self._charges[key]
            charge.refs -= 1
            if charge.refs:
                return
            del self._charges[key]
        self.account.credit(charge.tier, charge.nbytes)

    @contextlib.contextmanager
    def active(self):
        token = ACTIVE.set(self)
        try:
            yield
        finally:
            ACTIVE.reset(token)
