"""offload.checkpoint(fn, *args, **kwargs): recompute fn in backward instead of
keeping its activations.

Note [activation checkpointing]
The same scheme as torch.utils.checkpoint's non-reentrant variant: during
the forward, fn runs under saved-tensor hooks that keep only a numbered
placeholder for each tensor autograd would save; the first backward unpack of
a placeholder runs fn again from its saved inputs and hands out the
recomputed tensors by number. The graph of the original forward is the one
backward walks, so gradients reach the inputs and parameters as usual.

Why not torch.utils.checkpoint itself inside an engine: saved-tensor hooks do
not stack (only the innermost pair runs), and torch's recomputation installs
its own innermost pair. So what fn saves during recomputation never reaches
the ParameterManager or the ActivationSaver: a parameter saved there keeps
its gathered buffer alive after the manager released it and credited its
bytes, recomputed activations are invisible to the memory account, and a
parameter read outside its owner's forward (gathered on use in the forward)
is read released, as its placeholder. Here recomputation runs inside the
manager's forward context (gather on use) under hooks that pass every saved
tensor through the manager first: parameters become records gathered again
on use, activations are charged (Note [activation bytes] in saver.py).
Outside an engine's forward, offload.checkpoint is torch.utils.checkpoint
(use_reentrant=False).

The checkpoint's inputs are packed by the manager's pack hook itself, inside
the saver's `checkpoint_inputs()` (so they are charged, or moved to the host
with cpu_checkpointing), and kept by the frame as packed records; each
recomputation unpacks them through the manager (Note [recompute across torch
releases]). A frame lives as long as any of its placeholders: when backward
has used them all (or the graph is dropped unrun), the inputs and the
recomputed tensors go with it. Recomputation runs once per backward pass
(keyed by autograd's graph task), with the forward's RNG and autocast state.

Note [recompute across torch releases]
The frame once kept its inputs as the saved tensors of a no-op
autograd.Function whose output fed nothing, holding only that node's
`grad_fn` and reading `grad_fn.saved_tensors` in backward. That works on
torch 2.13 and 2.14 and fails on 2.11 ("Trying to backward through the graph
a second time (or directly access saved tensors after they have already
been freed)"). The cause is who owns a custom Function's node. On 2.11,
the Python `grad_fn` of an autograd.Function (its ctx, a THPFunction) holds
only a weak pointer to the C++ PyNode; the node is owned by the graph (its
outputs' autograd metadata, the edges of later nodes). An output that feeds
nothing dies at once, so does the node, and the node's death frees the
ctx's saved variables (the packed records with them, credited at once)
while the Python `grad_fn` lives on with `saved_tensors` unreadable.
PyTorch's change to Node wrapping (pytorch/pytorch#181390, from #179924:
"THPFunction holds an owning intrusive_ptr<Node>", as a C++ node's Python
wrapper always did) made the Python object own its node, so on 2.13 and 2.14 a
held `grad_fn` keeps its saved tensors.
The inputs now need no autograd node at all: the frame packs them with the
manager's own pack hook (`manager._pack`, the pair an engine's forward
installs; this path runs only inside an engine's forward context) and
unpacks them with `manager._unpack` at each recomputation, as it already did
for the recomputed tensors; so they reach the manager even where another
checkpoint function's hooks are innermost (a recomputation by torch's or
Hugging Face's checkpointing, Note [the model is the interface] in
partition/manager.py). Nothing depends on how a release ties a node to its
Python object; the records are the ones autograd would have kept, held as
long as the frame, so values, bytes and their timing are the same on every
release, and only public autograd API (`saved_tensors_hooks`) is used.
Nothing autograd's saving did is lost: with saved-tensor hooks installed,
autograd makes no version-counter check on a saved tensor anyway.
"""
from __future__ import annotations

import contextvars
import itertools
import time

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

from offload.activations.saver import ACTIVE, ActivationSaver

# Note [a recomputation inside another's]
# A checkpointed function called during a backward is being recomputed by
# someone else: Hugging Face's or torch's checkpointing around the engine's
# (gradient_checkpointing_enable with activation_checkpointing.modules). Its
# saved tensors are needed in that same backward, so checkpointing it again
# only computes it a third time: it runs as a plain call. Not inside the
# engine's own recomputation (OWN_RECOMPUTE), where a nested checkpointed
# function must save what its forward saved, its inputs. Before, on a GPU
# (autograd's device thread) each such layer was recomputed once more by the
# engine; on the CPU torch's checkpoint did the same, uncounted.
OWN_RECOMPUTE: contextvars.ContextVar[bool] = contextvars.ContextVar("offload_own_recompute", default=False)


class _Placeholder:
    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int):
        self.index = index


_fresh_ids = itertools.count(start=-2, step=-1)


class _Frame:
    def __init__(self, saver: ActivationSaver, fn, args: tuple, kwargs: dict, *, inputs_to_host: bool = False):
        self.saver = saver
        self.manager = saver.manager
        self.fn = fn
        self.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {k: None if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.tensor_slots = [("a", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.tensor_slots += [("k", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        self.requires_grad = [t.requires_grad for t in tensors]
        self.meta: list[tuple] = []  # (shape, dtype, device) of each tensor the forward saved
        # What the forward would have kept had it not been checkpointed: the bytes of the
        # distinct storages it saved, parameters aside, as the saver would have charged
        # them (Note [activations in the plan] in activations/plan.py).
        self.would_save: dict[tuple, tuple[StorageWeakRef, int]] = {}
        self._freed_bytes = 0
        self.recomputed: dict[int, dict[int, object]] = {}  # graph task -> index -> packed
        self.cpu_rng = torch.get_rng_state()
        self.device_type = torch_checkpoint._infer_device_type(*tensors)
        self.device_ids, self.device_rng = torch_checkpoint.get_device_states(*tensors)
        self.autocast = [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                         for dev in sorted({"cpu", saver.device.type})]
        # Packed as the forward's hooks would pack a saved tensor (Note [recompute across torch releases]).
        with saver.checkpoint_inputs(to_host=inputs_to_host):
            self.inputs = [self.manager._pack(t) for t in tensors]

    # ---- forward ---------------------------------------------------------
    def run(self, args: tuple, kwargs: dict):
        with torch.autograd.graph.saved_tensors_hooks(self._pack_placeholder, self._unpack_placeholder):
            return self.fn(*args, **kwargs)

    def _pack_placeholder(self, t: torch.Tensor) -> _Placeholder:
        self.meta.append((t.shape, t.dtype, t.device))
        if t.layout == torch.strided and t.device.type != "meta":
            with torch._C.DisableTorchFunction():  # Note [bookkeeping outside the mode] in partition/manager.py
                storage = t.untyped_storage()
                # A live parameter's storage: the manager's pack keeps it as itself or a record, uncharged.
                if storage.data_ptr() not in self.manager._live:
                    self._would_save(storage)
        return _Placeholder(len(self.meta) - 1)

    def _would_save(self, storage) -> None:
        """Counts a storage the forward saved once however many saved tensors view it. The
        placeholder keeps none alive, so an address seen before may be a new storage the
        allocator put where a freed one was: told apart by a weak reference to the first."""
        key = (storage.device.type, storage.device.index, storage.data_ptr())
        seen = self.would_save.get(key)
        if seen is not None and not seen[0].expired():
            return
        if seen is not None:
            self._freed_bytes += seen[1]
        self.would_save[key] = (StorageWeakRef(storage), storage.nbytes())

    @property
    def would_save_bytes(self) -> int:
        return self._freed_bytes + sum(n for _, n in self.would_save.values())

    # ---- backward --------------------------------------------------------
    def _unpack_placeholder(self, placeholder: _Placeholder) -> torch.Tensor:
        task = torch._C._current_graph_task_id()
        if task == -1:  # unpacked outside a backward pass: a pass of its own
            task = next(_fresh_ids)
        store = self.recomputed.get(task)
        if store is None:
            store = self.recomputed[task] = self._recompute()
        try:
            packed = store.pop(placeholder.index)
        except KeyError:
            raise RuntimeError(
                "offload.checkpoint: a saved activation of a checkpointed function was unpacked twice in "
                "one backward pass; call ctx.saved_tensors once per backward") from None
        return self.manager._unpack(packed)

    def _recompute(self) -> dict[int, object]:
        inputs = iter([self.manager._unpack(packed) for packed in self.inputs])
        args, kwargs = list(self.args), dict(self.kwargs)
        for (where, key), needs_grad in zip(self.tensor_slots, self.requires_grad):
            t = next(inputs).detach().requires_grad_(needs_grad)
            if where == "a":
                args[key] = t
            else:
                kwargs[key] = t
        store: dict[int, object] = {}
        counter = itertools.count()

        def pack(t: torch.Tensor):
            index = next(counter)
            if index >= len(self.meta):
                raise RuntimeError(f"offload.checkpoint: the recomputation of {_name(self.fn)} saved more "
                                   f"tensors than its forward ({len(self.meta)}): a checkpointed function "
                                   "must run the same operations both times")
            got, want = (t.shape, t.dtype, t.device), self.meta[index]
            if got != want:
                raise RuntimeError(f"offload.checkpoint: saved tensor {index} of {_name(self.fn)} was "
                                   f"{_show(want)} in the forward and {_show(got)} in the recomputation: "
                                   "a checkpointed function must compute the same values both times")
            store[index] = self.manager._pack(t.detach() if t.requires_grad else t)

        def unpack(_):
            raise RuntimeError("offload.checkpoint: backward inside a checkpointed function's "
                               "recomputation is not supported")

        start = time.perf_counter() if self.saver.profile else 0.0
        with torch.random.fork_rng(devices=self.device_ids, device_type=self.device_type):
            torch.set_rng_state(self.cpu_rng)
            torch_checkpoint.set_device_states(self.device_ids, self.device_rng, device_type=self.device_type)
            token = OWN_RECOMPUTE.set(True)
            try:
                with self.manager.forward_context(new_pass=False), torch.enable_grad(), _autocast(self.autocast), \
                        torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    self.fn(*args, **kwargs)
            finally:
                OWN_RECOMPUTE.reset(token)
        if len(store) != len(self.meta):
            raise RuntimeError(f"offload.checkpoint: the recomputation of {_name(self.fn)} saved "
                               f"{len(store)} tensors, its forward {len(self.meta)}: a checkpointed "
                               "function must run the same operations both times")
        if self.saver.profile:
            _sync(self.saver)
            self.saver.timings["recompute_s"] += time.perf_counter() - start
            self.saver.timings["recomputations"] += 1
        return store


def checkpoint(fn, *args, **kwargs):
    """fn(*args, **kwargs), keeping only its inputs for backward and running it again there.

    Inside an engine's forward the recomputation gathers parameters through the
    engine and its activations are charged to the device tier (Note
    [activation checkpointing]); elsewhere this is torch.utils.checkpoint with
    use_reentrant=False. fn must compute the same operations from the same
    inputs both times (RNG and autocast state are restored for it).
    """
    if not callable(fn):
        raise TypeError(f"offload.checkpoint: fn must be callable, got {type(fn).__name__}")
    if torch._C._current_graph_task_id() != -1 and not OWN_RECOMPUTE.get():
        return fn(*args, **kwargs)  # Note [a recomputation inside another's]
    saver = ACTIVE.get()
    if saver is None:
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpointed_call(saver, fn, args, kwargs)[0]


def checkpointed_call(saver: ActivationSaver, fn, args: tuple, kwargs: dict, *,
                      inputs_to_host: bool = False) -> tuple[object, int]:
    """fn(*args, **kwargs) checkpointed inside an engine's forward, and the bytes its
    forward would have saved unchecked. inputs_to_host: its inputs go to the host
    (the activation plan's choice, Note [activations in the plan])."""
    _sync(saver)
    start = time.perf_counter() if saver.profile else 0.0
    frame = _Frame(saver, fn, args, kwargs, inputs_to_host=inputs_to_host)
    out = frame.run(args, kwargs)
    _sync(saver)
    if saver.profile:
        saver.timings["checkpointed_forward_s"] += time.perf_counter() - start
        saver.timings["checkpointed_calls"] += 1
    return out, frame.would_save_bytes


def _sync(saver: ActivationSaver) -> None:
    # synchronize_checkpoint_boundary (and profiling, on a device apart from the host):
    # wait for the device at each boundary.
    if saver.wait_for_device is not None and (saver.synchronize or saver.profile):
        saver.wait_for_device()


class _autocast:
    def __init__(self, states):
        self.managers = [torch.autocast(dev, enabled=on, dtype=dtype) for dev, on, dtype in states]

    def __enter__(self):
        for m in self.managers:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self.managers):
            m.__exit__(*exc)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _show(meta: tuple) -> str:
    shape, dtype, device = meta
    return f"{tuple(shape)} {dtype} on {device}"
