"""`offload.init(config)`: build a model straight into its home tiers.

    with offload.init(config):
        model = MyModel(...)                    # parameters go home as it is built
    engine = offload.initialize(model, config)  # adopts them, reads nothing twice

Note [building in place]
Why: a model whose fp32 weights exceed host RAM cannot be built and then
offloaded. Here each parameter moves to its home (NVMe file, host partition,
or the device, by the same rule as initialize: `HomePolicy` in build.py) while
the model is still being constructed, so the process holds about one
module's parameters at a time.

When a parameter goes home. Two global registration hooks of torch (no
monkeypatching; both removed when the context exits):
  module registration (`parent.child = m`, ModuleList.append, add_module):
    the child's constructor has finished, so its parameters have their
    initial values; every parameter of its subtree not yet homed goes home.
  parameter registration on a module already attached (`lm_head.weight =
    wte.weight`, a replaced nn.Parameter): that parameter goes home at once.
  parameter registration on a module not attached yet: the parameters of
    other unattached modules go home (`nn.Sequential(*(Block() for ...))`
    builds every block before attaching any; without this the whole model
    would be in memory first). One of those may be an ancestor still being
    built; if it writes its parameters again, the mode below catches it.
The root's own parameters go home at context exit (or earlier by the rule
above).

Parameters used after they went home. Constructors often initialise again
after the children are attached (`self.apply(self._init_weights)`, Hugging
Face `post_init`, nanoGPT's scaled init of c_proj). A TorchFunctionMode
active inside the context sees every torch function given a homed parameter:
it gathers the parameter (Shard.gather, as in training) and keeps it
*open*. A function that writes (an in-place op on the parameter or on a
tensor sharing its storage, `out=`, `param.data = value`) or that returns a
tensor sharing its storage (`param.data`, a view: whatever is done with it
next may write) marks it dirty. An open parameter is closed, written back to
its home when dirty and released, when the next module is attached, when the
open ones pass a byte window (FIFO), and at exit. Functions that read only
metadata (`.shape`, `.size()`, `.requires_grad_()`) gather nothing.

Limits. A view of a parameter kept past its closing and written after is not
written back (the window is large: four times the largest parameter and at
least 64 MiB). `param.data = value` must keep the shape and dtype (precision
comes from the config, not from `model.half()` inside the context). Modules
stored without registration (`self._modules[name] = m`) go home only at exit.
Inside the context, parameters read outside a torch function see a
placeholder (zeros). After it and before initialize they are managed as an
engine's are (Note [reading a parameter outside the engine] in
partition/managed.py): a read (a clone, `copy.deepcopy` of a module, as
PEFT's modules_to_save does) gathers the real values, a write goes home. With
several ranks, every rank builds the same model in the same order (gathers
are collectives). The NVMe store is created before the model's size is
known, so a full disk shows up as a write error, not at the preflight check.

The builder (stores, accounting, shards) is kept, after the context exits,
in a list of builders waiting for `offload.initialize`, which finds the one
that holds its model's parameters and takes it over (build.build_shards).
`builder.close()` discards one that will not be used.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.overrides import TorchFunctionMode

import offload.device
from offload.aio.run_dir import RunDirectories
from offload.config import Config
from offload.engine.budgets import default_host_budget
from offload.engine.build import HomePolicy, discard_home, shard_context
from offload.engine.stores import open_swap_store
from offload.process_memory import release_free_host_memory
from offload.accounting import MemoryAccount
from offload.transfers.layout import make_layout
from offload.partition.managed import manage, unmanage
from offload.partition.quantized import quantized_kind
from offload.partition.gather_on_use import tensor_leaves
from offload.transfers.nvme_home import ParamStore
from offload.partition.shard import Shard
from offload.partition.shard_context import Residency
from offload.tiers import Tier
from offload.torch_release import check_torch_release

_MIN_WINDOW = 64 << 20
_TRIM_EVERY = 32 << 20  # bytes homed between returns of freed heap memory to the OS
_DEFAULT_STAGING = 64 << 20
_DATA_GET = torch.Tensor.data.__get__
_DATA_SET = torch.Tensor.data.__set__
_METADATA_GET = {"shape", "dtype", "device", "requires_grad", "is_leaf", "layout", "ndim", "is_cuda",
                 "is_meta", "grad", "grad_fn", "names", "is_sparse", "is_quantized", "is_nested",
                 "itemsize", "_backward_hooks", "_post_accumulate_grad_hooks"}
_METADATA_SET = {"requires_grad", "grad", "_backward_hooks", "_post_accumulate_grad_hooks"}
_METADATA_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
                     "is_complex", "requires_grad_", "__hash__", "get_device", "__len__",
                     "register_hook", "register_post_accumulate_grad_hook"}
_NOT_INPLACE_DUNDERS = {"__init__", "__iter__", "__index__", "__int__", "__invert__", "__instancecheck__"}

# Builders whose context has exited and whose model offload.initialize has not taken yet.
_WAITING: list["ModelBuilder"] = []


def init(config) -> "ModelBuilder":
    """A context in which constructed parameters go straight to their home tiers.

    config: the one offload.initialize will get (dict, JSON path or Config).
    """
    check_torch_release()
    return ModelBuilder(Config.load(config))


def claim(model: torch.nn.Module, config: Config) -> "ModelBuilder | None":
    """The waiting builder that holds `model`'s parameters (taken off the list), or None."""
    for builder in _WAITING:
        if any(builder.shard_of.get(id(p)) is not None and builder.shard_of[id(p)].param is p
               for p in model.parameters()):
            builder.check_same_config(config)
            _WAITING.remove(builder)
            unmanage(builder.shards)  # the engine's build moves them, then manages them itself
            return builder
    return None


def _metadata_only(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        return attr in (_METADATA_GET if name == "__get__" else _METADATA_SET)
    return name in _METADATA_METHODS


def _writes(func, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if kwargs.get("out") is not None or name == "__setitem__":
        return True
    if name.startswith("__i") and name.endswith("__"):
        return name not in _NOT_INPLACE_DUNDERS
    return name.endswith("_") and not name.endswith("__")


def _storage_ptrs(obj) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensor_leaves(obj)
            if t.layout == torch.strided and t.device.type != "meta"}


class _HomedParameterUse(TorchFunctionMode):
    """Gathers a homed parameter when model code uses it inside offload.init (Note [building in place])."""

    def __init__(self, builder: "ModelBuilder"):
        super().__init__()
        self.builder = builder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        b = self.builder
        if b.internal or _metadata_only(func):
            return func(*args, **kwargs)
        if func == _DATA_SET and id(args[0]) in b.shard_of:
            b.assign(b.shard_of[id(args[0])], args[1])
            return None
        touched = [b.shard_of[id(t)] for t in tensor_leaves((args, kwargs)) if id(t) in b.shard_of]
        for shard in touched:
            b.open(shard)
        out = func(*args, **kwargs)
        if b.opened:
            written = _storage_ptrs((args, kwargs)) if _writes(func, kwargs) else set()
            escaped = _storage_ptrs(out)
            if func == _DATA_GET:
                escaped.add(out.untyped_storage().data_ptr())
            b.mark_dirty(written | escaped)
            b.close_beyond_window(keep=touched)
        return out


class ModelBuilder:
    """What offload.init builds into: shards, their stores and the byte accounting."""

    def __init__(self, config: Config):
        self.config = config
        zero = config.zero_optimization
        if zero.stage3_param_persistence_threshold is None or not isinstance(
                zero.stage3_param_persistence_threshold, int):
            raise ValueError("offload.init: zero_optimization.stage3_param_persistence_threshold is "
                             f"{zero.stage3_param_persistence_threshold!r}; give a number of elements "
                             "('auto' needs the model's hidden size, unknown before it is built)")
        mem = config.memory
        self.account = MemoryAccount({Tier.DEVICE: mem.device_budget, Tier.HOST: mem.host_budget})
        # Build-time context: no parameter store until the first NVMe home (_ensure_store);
        # initialize moves the shards it adopts into the engine's context.
        # The run's one device layer (Note [one device choice]): initialize takes it over.
        self.ctx = shard_context(config, offload.device.from_env(), make_layout(config.zero_optimization.group_size),
                                 self.account)
        # Note [building into the plan] (offload/placement.py): the host budget before
        # anything is built, which initialize's plan then uses too.
        self.auto_host = None
        if config.zero_optimization.offload_param.auto:
            from offload.node import node_share

            self.auto_host = default_host_budget(config, node_share(self.ctx.pg).local_ranks)
        self.policy = HomePolicy(config, world_size=self.ctx.pg.world_size, auto_host=self.auto_host,
                                 separate_memory=self.ctx.layer.separate_memory)
        self.shards: list[Shard] = []
        self.shard_of: dict[int, Shard] = {}
        self.next_index = 0
        self.store = None
        self.run_dirs = RunDirectories()  # its store's directory, handed to initialize
        self.internal = False
        self.opened: dict[Shard, bool] = {}  # open shard -> dirty, in opening order
        self._open_bytes = 0
        self._largest = 0
        self._homed_since_trim = 0
        self._attached = weakref.WeakSet()  # modules registered on a parent
        self._roots = weakref.WeakSet()     # modules with parameters, not (yet) attached
        self._hooks = []
        self._mode = None
        self._state = "new"

    # ---- the context -------------------------------------------------------
    def __enter__(self) -> "ModelBuilder":
        if self._state != "new":
            raise RuntimeError("an offload.init context can be entered once")
        if any(b._state == "building" for b in _ACTIVE):
            raise RuntimeError("offload.init contexts do not nest")
        self._state = "building"
        _ACTIVE.add(self)
        self._hooks = [register_module_module_registration_hook(self._on_module),
                       register_module_parameter_registration_hook(self._on_parameter)]
        self._mode = _HomedParameterUse(self)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                for module in list(self._roots):
                    self._home_subtree(module)
            self.close_open()
            release_free_host_memory()
        finally:
            self._mode.__exit__(None, None, None)
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            _ACTIVE.discard(self)
        if exc_type is not None:
            self.close()
            return
        self._state = "built"
        if self.shards:
            _WAITING.append(self)
            # Until initialize takes them, reads see real values (PEFT copies modules_to_save
            # before initialize) and writes go home: Note [reading a parameter outside the engine].
            manage(_BuiltModel(self), self.shards)

    # ---- homing ------------------------------------------------------------
    def _on_module(self, parent, name, child) -> torch.nn.Module | None:
        if self.internal or child is None:
            return None
        # Construction moved on: what was opened for the previous module is done.
        self.close_open()
        replaced = self._quantize(name, child) if self.config.frozen.quantize is not None else None
        child = replaced or child
        self._attached.add(child)
        self._roots.discard(child)
        self._home_subtree(child)
        return replaced  # torch registers the returned module in child's place

    def _quantize(self, name: str, child: torch.nn.Module) -> torch.nn.Module | None:
        """frozen.quantize: each nn.Linear of the subtree attached (but skip_modules) becomes
        bitsandbytes' quantized layer before anything of it goes home (Note [quantized frozen
        weights] in partition/quantized.py); returns child's replacement where it is one."""
        from offload.partition.quantized import quantized_linear, to_quantize

        replacement = None
        self.internal = True
        try:
            for path, linear in to_quantize(child, self.config.frozen, prefix=name):
                if id(linear.weight) in self.shard_of:
                    raise RuntimeError(f"offload.init: {path} (nn.Linear) went home before it was attached, "
                                       "so frozen.quantize cannot quantize it; attach each Linear as it is built "
                                       "(self.proj = nn.Linear(...)), or name it in frozen.skip_modules")
                layer = quantized_linear(linear, self.config.frozen, self.ctx.device)
                if path == name:
                    replacement = layer
                else:
                    owner, _, local = path[len(name) + 1:].rpartition(".")
                    setattr(child.get_submodule(owner) if owner else child, local, layer)
        finally:
            self.internal = False
        return replacement

    def _on_parameter(self, module, name, param) -> None:
        if self.internal or param is None:
            return
        if module in self._attached:
            self._home(param, name)
            return
        # A new module's parameter: modules built before it, not yet attached
        # (nn.Sequential(*(Block() for ...)) builds every child first), are
        # complete unless they are this one's ancestors still being built; a
        # later write to those is caught by the mode and written back.
        for other in list(self._roots):
            if other is not module:
                self._roots.discard(other)
                self._home_subtree(other)
        self._roots.add(module)

    def _home_subtree(self, module: torch.nn.Module) -> None:
        for name, p in module.named_parameters():
            self._home(p, name)

    def _home(self, p: torch.nn.Parameter, name: str) -> None:
        if id(p) in self.shard_of or p.device.type == "meta":
            return
        if not p.is_floating_point() and quantized_kind(p) is None:
            raise TypeError(f"offload.init: parameter {name} has dtype {p.dtype}; offload trains "
                            "floating-point parameters")
        self.internal = True
        try:
            home = self.policy.home_of(p)
            if home is Tier.DEVICE:  # stays a plain parameter until initialize
                p.data = p.data.to(self.ctx.device)
                return
            if home is Tier.NVME:
                self._ensure_store()
            # Built in the parameter's own dtype: initialize needs the original
            # values for the fp32 masters, and converts to the compute dtype there.
            shard = Shard(self.next_index, name, p, compute_dtype=p.dtype, home=home, ctx=self.ctx)
            self.next_index += 1
            shard.adopt(p.detach())
            self.shards.append(shard)
            self.shard_of[id(p)] = shard
            self._largest = max(self._largest, shard.padded_numel * shard.dtype.itemsize)
            self._homed_since_trim += shard.numel * p.element_size()
            if self._homed_since_trim >= _TRIM_EVERY:
                # A constructor allocates each weight before the previous one is
                # homed and freed, between small allocations; glibc then keeps the
                # freed chunks in its heap. Measured: 60 layers of 4 MB built in
                # place left RSS 243 MB higher, 12 MB with this.
                release_free_host_memory()
                self._homed_since_trim = 0
        finally:
            self.internal = False

    def _ensure_store(self) -> None:
        if self.store is not None:
            return
        op = self.config.zero_optimization.offload_param
        staging = (op.buffer_count * op.buffer_size * 4 if op.buffer_count and op.buffer_size
                   else _DEFAULT_STAGING)
        # Sized for no tensor in particular: the model's size is not known yet.
        self.store = open_swap_store(op.nvme_path, [], staging, self.config, self.ctx.pg, self.account,
                                     self.run_dirs)
        # Shards homed before this one are on the host or the device and never ask for a store.
        self.ctx = dataclasses.replace(self.ctx, param_store=ParamStore(self.store, self.ctx.pg))

    # ---- parameters used while building -------------------------------------
    def open(self, shard: Shard) -> None:
        if shard in self.opened:
            return
        self.internal = True
        try:
            shard.gather()
        finally:
            self.internal = False
        self.opened[shard] = False
        self._open_bytes += shard.padded_numel * shard.dtype.itemsize

    def mark_dirty(self, ptrs: set[int]) -> None:
        if not ptrs:
            return
        for shard in self.opened:
            if shard.full_storage_ptr() in ptrs:
                self.opened[shard] = True

    def assign(self, shard: Shard, value: torch.Tensor) -> None:
        """`param.data = value` on a homed parameter: the value is copied into its home."""
        if tuple(value.shape) != tuple(shard.shape) or value.dtype != shard.dtype:
            raise TypeError(
                f"offload.init: parameter {shard.name} ({shard.dtype}, {list(shard.shape)}) was "
                f"assigned .data of {value.dtype}, {list(value.shape)}; inside offload.init a "
                "parameter keeps its shape and dtype (precision comes from the config)")
        self.open(shard)
        self.internal = True
        try:
            shard.param.data.copy_(value)
        finally:
            self.internal = False
        self.opened[shard] = True

    def close_beyond_window(self, keep) -> None:
        window = max(_MIN_WINDOW, 4 * self._largest)
        for shard in list(self.opened):
            if self._open_bytes <= window:
                break
            if shard not in keep:
                self._close(shard)

    def close_open(self) -> None:
        for shard in list(self.opened):
            self._close(shard)

    def _close(self, shard: Shard) -> None:
        dirty = self.opened.pop(shard)
        self._open_bytes -= shard.padded_numel * shard.dtype.itemsize
        self.internal = True
        try:
            if dirty:
                self._write_back(shard)
            shard.release()
        finally:
            self.internal = False

    def _write_back(self, shard: Shard) -> None:
        full = shard.param.data.reshape(-1)
        part = shard.my_slice(full)
        if shard.home is Tier.HOST:
            if shard.host_part.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
                shard.host_part.copy_(part)  # else the gathered value is the home itself
        else:
            self.ctx.param_store.write(shard, part.to("cpu").contiguous()).wait()

    # ---- hand-over to initialize, or discard ---------------------------------
    def check_same_config(self, config: Config) -> None:
        mine, theirs = self.config.zero_optimization, config.zero_optimization
        for key, a, b in (("zero_optimization.offload_param", mine.offload_param, theirs.offload_param),
                          ("zero_optimization.stage3_param_persistence_threshold",
                           mine.stage3_param_persistence_threshold, theirs.stage3_param_persistence_threshold),
                          ("memory", self.config.memory, config.memory)):
            if a != b:
                raise ValueError(f"offload.initialize: {key} is {b!r} but the model was built under "
                                 f"offload.init with {a!r}; give initialize the config given to init")

    def unclaim(self) -> None:
        if self._state == "built" and self not in _WAITING:
            _WAITING.append(self)
            manage(_BuiltModel(self), self.shards)

    def hand_over(self, keep: set[int], run_dirs: RunDirectories) -> None:
        """initialize took the shards of parameters in `keep`; the others (replaced or
        untied while building) are forgotten and their files removed."""
        for shard in self.shards:
            if id(shard.param) not in keep:
                discard_home(shard)
                if shard.home is Tier.NVME:
                    self.store.remove(f"param.{shard.index}")
        run_dirs.take(self.run_dirs)  # the engine's stores write beside this one's files
        self._state = "adopted"

    def close(self) -> None:
        """Discards what was built: the model's offloaded parameters are lost. Idempotent."""
        if self._state in ("closed", "adopted"):
            return
        self._state = "closed"
        if self in _WAITING:
            _WAITING.remove(self)
        for shard in self.shards:
            if shard.residency is not Residency.RELEASED:
                shard.force_release()
            discard_home(shard)
        if self.store is not None:
            self.store.close()
        self.run_dirs.remove()

    def __repr__(self) -> str:
        homes = {k.value: sum(s.home is k for s in self.shards) for k in Tier}
        return f"ModelBuilder({self._state}, shards={homes})"


class _BuiltModel:
    """What a ManagedParameter asks of its manager, for a model built under offload.init
    and not yet taken by initialize (which manages the parameters with its own)."""

    closed = False
    in_forward = False
    _internal = False

    def __init__(self, builder: ModelBuilder):
        self._builder = builder

    def hold(self, shard: Shard) -> torch.Tensor:
        if self._builder._state != "built":
            raise RuntimeError(f"parameter {shard.name}: its offload.init model was discarded "
                               "(builder.close()) before offload.initialize took it")
        return shard.gather()

    def drop(self, shard: Shard) -> None:
        shard.release()

    def write_edit(self, shard: Shard) -> None:
        self._builder._write_back(shard)


_ACTIVE: "weakref.WeakSet[ModelBuilder]" = weakref.WeakSet()
__all__ = ["init", "ModelBuilder", "claim"]
