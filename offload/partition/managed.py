"""Parameters read, edited or saved outside the engine's forward.

Note [reading a parameter outside the engine]
Between uses an offloaded parameter's `.data` is a placeholder (a zero
expanded to its shape). Inside a forward the manager gathers it before any
torch function sees it; outside, a user's `model.state_dict()`,
`save_pretrained`, `print(model.fc.weight)` or `weight.sum()` would see the
zeros. So for the engine's life every managed parameter's class is
`ManagedParameter`, a subclass of nn.Parameter (isinstance checks, optimizers,
Trainer and Accelerate see a Parameter) whose __torch_function__ looks at
each call given a released one outside a forward:
  metadata (shape, dtype, device, requires_grad, size(), hooks, ...) and
  conversions that would return the parameter itself (`.to(its device)`,
  Trainer's model.to(device)): passed through, nothing gathered;
  a read (detach, clone, arithmetic, repr, state_dict's detach): the
  parameter is gathered, the function runs, any result sharing the gathered
  buffer is copied, and the parameter is released: the caller gets the real
  values, never the buffer (which the next gather may reuse);
  a write to the parameter itself (in-place ops such as load_state_dict's
  copy_, `out=`, `param.data = value` of the same shape and dtype): written
  through: gathered, applied, written home and into the optimizer's fp32
  master (so training goes on from it), released;
  `.data` itself (an alias that may be written later, unseen) and writes
  through other aliases: refused, naming `offload.gathered(params,
  modifier_rank=0)`, which holds the parameters for a block of edits.
  A known gap: a read returns a copy, so `p[0].zero_()` (in-place on a
  slice) changes the copy only; write the parameter itself (`p[0] = 0`) or
  edit inside offload.gathered.
Note [writes to device homes]
A parameter homed on the device (offload_param none, one under
stage3_param_persistence_threshold such as a norm or a bias, or one the auto
plan put there) is never released: its `.data` is the home itself, so reads
need nothing. Its writes do: the optimizer steps an fp32 master kept apart
from the home, and its next update would publish the old master over the
edit. So a write to the parameter itself outside a forward (an in-place op,
`out=`, load_state_dict's copy_, `param.data = value` of the same shape and
dtype) waits for any update still writing the home, is applied, and is
taken into the master, as an offloaded parameter's is. A read outside a
forward waits for such an update too: after step() the updates may go on
beside the next forward (Note [updates under the next forward]), and a
read before the forward must see what the step wrote, as in plain PyTorch. `param.data = value`
copies into the home rather than replacing it (the engine's copies and
updates write the home's storage). Known gap: a write through an alias
taken earlier (`param.data.fill_(x)`, a view) is not seen; write the
parameter itself or edit inside offload.gathered.
Note [gradients users read]
After backward each gradient lives in its shard's fp32 partition, not in
`param.grad`. Trainer and Accelerate clip with
torch.nn.utils.clip_grad_norm_(model.parameters()), which reads p.grad and
scales it in place; model.zero_grad() sets p.grad = None. So with one rank
`p.grad` of a managed parameter is a view of its partition (fp32, the
parameter's shape): norms are computed and clipping is applied on the real
gradients, and `p.grad = None` clears the partition. With several ranks a
partition is not the whole gradient, and reading p.grad raises, naming the
config's gradient_clipping (engine.get_global_grad_norm() for the norm).

Inside a forward the manager's own rules apply (Note [when parameters are
gathered]). The engine's code changes `.data` with subclass handling off
(`engine_access`). Closing the engine gives the parameters their class back.
"""
from __future__ import annotations

import contextlib

import torch

from offload.partition.shard_context import Residency

# The engine's own access to param.data (Shard gathering and releasing).
engine_access = torch._C.DisableTorchFunctionSubclass

_METADATA_PROPERTIES = {"shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn",
                        "layout", "ndim", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse",
                        "is_quantized", "_backward_hooks", "_post_accumulate_grad_hooks", "itemsize",
                        "nbytes", "_version", "output_nr", "_base", "retains_grad", "is_nested"}
_METADATA_METHODS = {"size", "dim", "numel", "nelement", "stride", "element_size", "is_floating_point",
                     "is_complex", "get_device", "requires_grad_", "register_hook", "is_contiguous",
                     "register_post_accumulate_grad_hook", "retain_grad", "__hash__", "ndimension",
                     "type", "__len__", "is_shared", "is_pinned", "storage_offset", "is_signed",
                     "_is_view", "has_names", "__setstate__", "_has_compatible_shallow_copy_type"}
_CONVERSIONS = {"to", "cpu", "cuda", "float", "half", "bfloat16", "double", "type_as"}


def _name_of(func) -> tuple[str, str]:
    """(kind, name): ('get'|'set', property) for attribute access, ('call', name) otherwise."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return ("get" if name == "__get__" else "set"), getattr(owner, "__name__", "")
    return "call", name


def _is_write(name: str, kwargs: dict) -> bool:
    return kwargs.get("out") is not None or (name.endswith("_") and not name.startswith("__")) \
        or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__")


def _refuse(param, what: str) -> RuntimeError:
    shard = param._offload_shard
    where = ("is homed on the device, where the engine's copies and updates write its storage"
             if shard.home.value == "device" else
             f"lives offloaded ({shard.home.value}) between uses: outside the engine's forward its storage is a "
             "placeholder")
    return RuntimeError(
        f"{what} of parameter {shard.name}, which {where}. To edit it (or keep an alias), "
        "use `with offload.gathered(params, modifier_rank=0):` (edits are written home and into the "
        "optimizer's fp32 master); reads (state_dict(), detach(), clone(), any function of it) "
        "return its real values")


class ManagedParameter(torch.nn.Parameter):
    """An nn.Parameter whose value lives in a Shard (Note [reading a parameter outside the engine])."""

    _offload_original = torch.nn.Parameter  # the class `unmanage` gives back

    def __repr__(self):
        return "Parameter containing:\n" + repr(self.detach())

    def __deepcopy__(self, memo):
        """A plain nn.Parameter holding the real values (torch's own deepcopy clones
        `.data`, the placeholder): `copy.deepcopy(module)` copies what the model holds."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            copied = torch.nn.Parameter(self.detach().clone(), requires_grad=self.requires_grad)
        memo[id(self)] = copied
        return copied

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, name = _name_of(func)
        if name == "grad" and kind != "call":
            return _grad_access(kind, args)
        if kind != "call" and name != "data" or kind == "call" and name in _METADATA_METHODS:
            with engine_access():
                return func(*args, **kwargs)
        released = _released_outside_forward(args, kwargs)
        if not released:
            written = _device_home_written(kind, name, args, kwargs)
            if written is not None:
                return _write_device_home(written, kind, func, args, kwargs)
            with engine_access():
                return func(*args, **kwargs)
        first = released[0]
        if kind == "set":
            value = args[1] if len(args) > 1 else None
            if value is first:  # module._apply's `param.data = fn(param)` with fn a no-op
                return None
            if isinstance(value, torch.Tensor) and value.shape == first.shape and value.dtype == first.dtype:
                with torch.no_grad():  # `.data =` is invisible to autograd
                    _write(released, first, torch.Tensor.copy_, (first, value), {})
                return None
            raise _refuse(first, "`param.data = value` with another shape or dtype")
        if kind == "get":  # .data: an alias, maybe written later
            raise _refuse(first, "`.data`")
        if name in _CONVERSIONS and _converts_to_itself(func, args, kwargs):
            return first
        if _is_write(name, kwargs):
            target = kwargs.get("out") if kwargs.get("out") is not None else args[0]
            if any(target is p for p in released):
                _write(released, target, func, args, kwargs)
                return target
        return _read(released, func, args, kwargs)  # a write elsewhere reads the parameter


def _grad_access(kind: str, args):
    """Note [gradients users read]."""
    param = args[0]
    shard = getattr(param, "_offload_shard", None)
    with engine_access():
        if shard is None or param._offload_manager._internal:
            return (param.grad if kind == "get" else setattr(param, "grad", args[1])) if kind != "delete" \
                else delattr(param, "grad")
        if kind == "get":
            real = param.grad
            if real is not None:  # inside backward, before the hook takes it
                return real
            if not shard.gradient.pending or shard.gradient.part is None:
                return None
            if shard.gradient.group_share:  # Note [gradients across groups once a window]
                raise RuntimeError(
                    f"{shard.name}.grad: inside the accumulation window each shard group holds only its "
                    "share of the gradient, summed across groups at the window's last backward; read it "
                    "after that backward, or read the norm with engine.get_global_grad_norm()")
            if shard.ctx.pg.world_size > 1:
                raise RuntimeError(
                    f"{shard.name}.grad: with {shard.ctx.pg.world_size} ranks each holds a partition of the "
                    "gradient, not the whole; clip with the config's gradient_clipping (the engine clips "
                    "every update) and read the norm with engine.get_global_grad_norm()")
            return shard.gradient.part[:shard.numel].view(shard.shape)
        value = args[1] if kind == "set" else None
        if value is not None:
            raise RuntimeError(f"{shard.name}.grad = tensor: the engine keeps gradients in its partitions; "
                               "set p.grad = None to clear them, or scale them in place (p.grad.mul_(c))")
        shard.gradient.clear()
        return None


def _released_outside_forward(args, kwargs) -> list:
    from offload.partition.gather_on_use import tensor_leaves

    found = []
    with engine_access():
        for t in tensor_leaves((args, kwargs)):
            shard = getattr(t, "_offload_shard", None)
            if shard is None:
                continue
            if shard.residency is Residency.GATHERED:
                manager = t._offload_manager
                if (not manager.in_forward and shard.home.value == "device"
                        and (shard.in_flight.update is not None or shard.in_flight.copy_in is not None)):
                    _settle_device_home(t)
                continue
            manager = t._offload_manager
            if manager.closed:
                raise RuntimeError(f"parameter {shard.name}: its engine was closed and its value did not "
                                   "fit in memory to be given back; read or save the weights before "
                                   "engine.close() (state_dict(), engine.save_checkpoint)")
            if manager._internal:
                continue
            if manager.in_forward:
                manager.gather_on_use(shard)  # as the forward's mode does
                continue
            found.append(t)
    return found


def _settle_device_home(param) -> None:
    """A device home's new value may still be on its way (an update step() left running
    beside the next forward, its upload): a read or a write outside the engine waits for it,
    as the forward would (Note [writes to device homes])."""
    manager = param._offload_manager
    if manager.closed or manager._internal or manager.in_forward:
        return
    manager.hold(param._offload_shard)  # waits for the update and its copy-in (Shard.gather)
    manager.drop(param._offload_shard)


def _device_home_written(kind: str, name: str, args, kwargs):
    """The parameter a call writes, where it is homed on the device and the call comes
    from outside the engine's forward (Note [writes to device homes]); else None. The
    manager's state is asked first: inside a forward (a compiled block's trace too)
    nothing else is looked at."""
    if kind == "set" and name == "data":
        target, value = args[0], (args[1] if len(args) > 1 else None)
    elif kind == "call" and (args or kwargs.get("out") is not None):
        target, value = (kwargs.get("out") if kwargs.get("out") is not None else args[0]), None
    else:
        return None
    with engine_access():
        shard = getattr(target, "_offload_shard", None)
        if shard is None:
            return None
        manager = target._offload_manager
        if manager.in_forward or manager._internal or manager.closed or shard.home.value != "device":
            return None
        if kind == "call":
            return target if _is_write(name, kwargs) else None
        full = shard.full_buffer()
        if (full is not None and isinstance(value, torch.Tensor) and value.device == full.device
                and value.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()):
            return None  # the engine pointing the parameter at its own home (any thread)
    return target


def _write_device_home(param, kind: str, func, args, kwargs):
    """Note [writes to device homes]: the write is applied to the home after any update
    still writing it, then taken into the optimizer's fp32 master."""
    if kind == "set":
        value = args[1] if len(args) > 1 else None
        if value is param:
            return None
        if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dtype == param.dtype:
            with torch.no_grad():  # `.data =` is invisible to autograd
                _write([param], param, torch.Tensor.copy_, (param, value), {})
            return None
        raise _refuse(param, "`param.data = value` with another shape or dtype")
    _write([param], param, func, args, kwargs)
    return kwargs.get("out") if kwargs.get("out") is not None else param


def _converts_to_itself(func, args, kwargs) -> bool:
    """Whether this conversion of a parameter returns the parameter (same dtype, device)."""
    param = args[0]
    with engine_access():
        probe = torch.empty(0, dtype=param.dtype, device=param.device)
        out = func(probe, *args[1:], **kwargs)
    return isinstance(out, torch.Tensor) and out.dtype == param.dtype and out.device == param.device


@contextlib.contextmanager
def _holding(params: list):
    """Holds each distinct shard of `params` for one call; yields the shards held."""
    manager = params[0]._offload_manager
    held = []
    try:
        with engine_access():
            for p in params:
                if p._offload_shard not in held:
                    manager.hold(p._offload_shard)
                    held.append(p._offload_shard)
            yield held
    finally:
        with engine_access():
            for shard in held:
                manager.drop(shard)


def _read(params: list, func, args, kwargs):
    """A read: the function runs on the gathered values; results sharing a gathered
    buffer are copied (the next gather may reuse it)."""
    with _holding(params) as held:
        buffers = {s.full_storage_ptr() for s in held}
        out = func(*args, **kwargs)
        return torch.utils._pytree.tree_map(
            lambda x: x.clone() if isinstance(x, torch.Tensor) and x.layout == torch.strided
            and x.untyped_storage().data_ptr() in buffers else x, out)


def _write(params: list, target, func, args, kwargs):
    """An in-place op (or `param.data = value` of the same shape and dtype) on a released
    parameter: gathered, applied, written home and into the fp32 master, released."""
    with _holding(params):
        result = func(*args, **kwargs)
        target._offload_manager.write_edit(target._offload_shard)
        return result


def manage(manager, shards) -> None:
    """Gives each shard's parameter the ManagedParameter class, for the engine's life."""
    for shard in shards:
        p = shard.param
        if not isinstance(p, ManagedParameter):
            # The same object (the model, the user's optimizer and their param groups hold it), another
            # class: torch dispatches __torch_function__ by the tensor's class (Note [reading a parameter
            # outside the engine]). A Parameter subclass (bitsandbytes' Params4bit) keeps its own class
            # below ours: its attributes (quant_state) and isinstance checks stay.
            p.__class__ = managed_class(type(p))
        p._offload_shard = shard
        p._offload_manager = manager


_MANAGED: dict[type, type] = {}


def managed_class(cls: type) -> type:
    """ManagedParameter over a parameter's own class: ManagedParameter itself for an
    nn.Parameter, else a subclass of both (one per class), ManagedParameter first."""
    if cls is torch.nn.Parameter:
        return ManagedParameter
    if cls not in _MANAGED:
        _MANAGED[cls] = type(cls.__name__, (ManagedParameter, cls), {"_offload_original": cls,
                                                                     "__module__": cls.__module__,
                                                                     "to": _to_in_place})
    return _MANAGED[cls]


def _to_in_place(self, *args, **kwargs):
    """`.to()` of a managed parameter whose class has its own (bitsandbytes' Params4bit
    re-wraps its data and moves its quant_state): Trainer's and Accelerate's
    model.to(its device) gets the parameter itself, as for any managed parameter;
    another device or dtype is refused rather than letting the class rewrap the
    placeholder (which module._apply would then write home over the real bytes)."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    with engine_access():
        here, own = self.device, self.dtype
    if (device is None or torch.device(device).type == here.type) and dtype in (None, own):
        return self
    raise RuntimeError(f"parameter {self._offload_shard.name} ({type(self).__name__}) is placed by the engine: "
                       f".to({device or dtype}) would convert it; the engine computes on {here} (leave the "
                       "model where initialize put it)")


def refuse_state_dict_larger_than_memory(module: torch.nn.Module, shards) -> object:
    """A state_dict() pre-hook: every value it returns is a copy in host memory, so
    a model larger than the memory available is refused before the first copy."""
    offloaded = sum(s.numel * s.original_dtype.itemsize for s in shards if s.home.value != "device")

    def pre_hook(mod, prefix, keep_vars):
        if prefix or keep_vars:  # submodules' calls are parts of the outermost; keep_vars copies nothing
            return
        import psutil

        available = psutil.virtual_memory().available
        if offloaded > 0.9 * available:
            raise MemoryError(
                f"state_dict(): the offloaded parameters take {offloaded / 2**30:.1f} GiB as full tensors "
                f"and {available / 2**30:.1f} GiB of memory is available. Stream them instead: "
                "engine.save_checkpoint(dir) then offload.consolidate(dir, 'model.safetensors') (one tensor "
                "at a time), or read a few at a time with offload.gathered(params)")

    return module.register_state_dict_pre_hook(pre_hook)


def unmanage(shards) -> None:
    """The engine is closing: plain nn.Parameters again."""
    for shard in shards:
        p = shard.param
        if isinstance(p, ManagedParameter):
            p.__class__ = p._offload_original  # the swap above, undone
        for attr in ("_offload_shard", "_offload_manager"):
            p.__dict__.pop(attr, None)


@contextlib.contextmanager
def gathered(params, modifier_rank: int | None = None):
    """Holds the full values of `params` (offloaded parameters of one engine) for the block.

    modifier_rank: the rank whose edits count (0 with one process); at exit every
    parameter whose value changed is written home and into the optimizer's fp32
    master, so training goes on from the edited value. None: read only (edits
    are refused at exit rather than lost). DeepSpeed's
    zero.GatheredParameters(params, modifier_rank=...) in spirit.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    managed = [p for p in params if getattr(p, "_offload_shard", None) is not None]
    managers = {id(p._offload_manager): p._offload_manager for p in managed}
    if len(managers) > 1:
        raise ValueError("offload.gathered: the parameters belong to different engines; gather each "
                         "engine's separately")
    if not managed:
        yield params
        return
    manager = next(iter(managers.values()))
    shards = list(dict.fromkeys(p._offload_shard for p in managed))
    pg = shards[0].ctx.pg
    if modifier_rank is not None and not 0 <= modifier_rank < pg.job_size:
        raise ValueError(f"offload.gathered: modifier_rank {modifier_rank} is not a rank "
                         f"(world size {pg.job_size})")
    before = []
    with engine_access():
        for shard in shards:
            manager.hold(shard)
            before.append(shard.home_partition())
    try:
        yield params
        with engine_access():
            for shard, old in zip(shards, before):
                if modifier_rank is not None and pg.job_size > 1:
                    pg.broadcast(shard.full_value_buffer(), modifier_rank)
                changed = not torch.equal(shard.gathered_partition(), old)
                if changed and modifier_rank is None:
                    # The buffer may be the home itself (and the master): undo, then say so.
                    shard.gathered_partition().copy_(old)
                    shard.write_home()
                    raise RuntimeError(f"offload.gathered: parameter {shard.name} was changed inside a "
                                       "read-only block; pass modifier_rank=0 to keep edits")
                if changed:
                    manager.write_edit(shard)
    finally:
        with engine_access():
            for shard in shards:
                manager.drop(shard)
