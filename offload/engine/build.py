"""Turns a model's parameters into shards at their home tiers, at initialize.

Two steps, in this order (Engine._build): `build_shards` decides every home,
checks the budgets, opens the swap stores and makes the one ShardContext and
the shards, moving nothing; `Built.place` then moves the parameters home, one
at a time, handing each one's original fp32 value to the optimizer as its
master before taking the next, so building never holds a second copy of the
whole model (the optimizer is built empty and places nothing). Each shard's
initial value comes from one of three places (`Built._initial_partition`):
  the parameter itself   the ordinary case
  the weights            `initialize(..., weights=...)`: one tensor read at a
                         time (offload/engine/weights.py); meta parameters get
                         a stride-0 placeholder parameter, filled when homed
  its build-time home    a model built under `offload.init`: the partition
                         already at home is adopted (Note [building in place]
                         in offload/engine/init_context.py); it is read once,
                         to initialise the fp32 master, and rewritten only
                         when the compute dtype differs from the built one
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from offload.aio.buffer_pool import BufferPool, PinnedLedger
from offload.aio.memory import BufferCache, pin_host_home, pins
from offload.aio.run_dir import RunDirectories
from offload.config import Config
from offload.device import DeviceLayer
from offload.accounting import MemoryAccount
from offload.transfers.collectives import ProcessGroupInfo
from offload.transfers.device_copies import CopyStreams
from offload.transfers.nvme_home import ParamStore
from offload.engine import budgets
from offload.engine.reserve import Reserve, reserve, settle_plan
from offload.engine.stores import check_free_space, open_store
from offload.partition.quantized import (check_layers, check_quantized, check_quantized_base, page_modules,
                                         quantized_kind, state_bytes)
from offload.partition.shard import Shard
from offload.partition.shard_context import PartitionStore, ShardContext, partition_numel
from offload.placement import Placement
from offload.tiers import Tier, grad_tier_of


class HomePolicy:
    """Where a parameter lives, decided one parameter at a time: the device when
    offload_param is none or it is under stage3_param_persistence_threshold
    elements, else host or NVMe. With offload_param "auto" (a model built under
    offload.init, before the whole model is known), the host pass of the plan
    as far as it can be made in order (Note [building into the plan] in
    offload/placement.py): the host while the host budget `auto_host` holds a
    whole shard in fp32 (home and state, 12 bytes an element) or a home in a
    lower precision, else NVMe where a path is given; initialize plans the
    whole model and moves what its plan puts elsewhere."""

    def __init__(self, config: Config, *, world_size: int = 1, auto_host: int | None = None,
                 separate_memory: bool = False):
        zero = config.zero_optimization
        self.param_tier = zero.offload_param.device
        self.threshold = zero.stage3_param_persistence_threshold
        # offload_param.max_in_cpu (DeepSpeed's meaning): with NVMe offload, keep
        # the first parameters, up to this many elements, in host memory instead.
        self.in_cpu_left = zero.offload_param.max_in_cpu or 0
        self.auto_nvme = zero.offload_param.auto and zero.offload_param.nvme_path is not None
        self.config, self.world_size, self.separate_memory = config, world_size, separate_memory
        self.auto_host = auto_host  # the host budget the build started with
        self.auto_host_held = 0  # bytes of it the homes put on the host so far would take
        self.largest_part = 0
        # Host bytes an element of a home on the host costs the plan's host pass: in
        # fp32 the whole shard (its home is the master), else the home alone first;
        # nothing more where the state is on the host anyway in fp32.
        itemsize, state = config.precision.dtype.itemsize, zero.offload_optimizer
        if state.auto:
            self.auto_host_cost = 12 if itemsize == 4 else itemsize
        else:
            self.auto_host_cost = 0 if (state.device is Tier.HOST and itemsize == 4) else itemsize

    def home_of(self, p: torch.Tensor) -> Tier:
        if self.param_tier is Tier.DEVICE or p.numel() <= self.threshold:
            return Tier.DEVICE
        if self.auto_nvme:
            part = partition_numel(p.numel(), self.world_size)
            self.largest_part = max(self.largest_part, part)
            room = (self.auto_host or 0) - budgets.build_reserve(self.config, self.largest_part,
                                                                 separate_memory=self.separate_memory)
            cost = p.element_size() if quantized_kind(p) is not None else self.auto_host_cost  # frozen: its home
            if self.auto_host_held + part * cost <= room:
                self.auto_host_held += part * cost
                return Tier.HOST
            return Tier.NVME
        if self.param_tier is Tier.HOST:
            return Tier.HOST
        if p.numel() <= self.in_cpu_left:
            self.in_cpu_left -= p.numel()
            return Tier.HOST
        return Tier.NVME


def shard_context(config: Config, layer: DeviceLayer, pg: ProcessGroupInfo, account: MemoryAccount, *,
                  param_store: PartitionStore | None = None, gathered_buffers: BufferCache | None = None,
                  streams: CopyStreams | None = None, lazy_grads: bool | None = None) -> ShardContext:
    """The one way a ShardContext is made: compute on the layer's device (Note [one
    device choice] in offload/device/__init__.py); gradients live where the
    config's optimizer tier puts them (`OffloadOptimizerConfig.grad_tier`), unless
    a shard's plan puts its state, and so its gradient, elsewhere (Shard.gradient.tier)."""
    optimizer = config.zero_optimization.offload_optimizer
    if streams is None and layer.separate_memory:
        streams = CopyStreams(layer)
    return ShardContext(device=layer.device, pg=pg, account=account, param_store=param_store,
                        grad_tier=optimizer.grad_tier,
                        lazy_grads=optimizer.device is Tier.NVME if lazy_grads is None else lazy_grads,
                        gathered_buffers=gathered_buffers, layer=layer, streams=streams)


@dataclass
class _Planned:
    """One parameter's shard before it exists: where it goes and how big it is
    (enough to size the stores and check the budgets before anything moves)."""

    index: int
    name: str
    param: torch.nn.Parameter
    given_home: Tier | None  # HomePolicy's or the builder's; None: the auto placement decides
    part_numel: int
    padded_numel: int
    built: Shard | None  # its build-time shard (offload.init), reused as it is when `reuse`
    reuse: bool = False
    trainable: bool = True  # requires_grad at initialize (Note [frozen parameters] in offload/placement.py)
    home: Tier | None = None  # where it lives: set by the placement (Note [automatic placement])
    # A quantized frozen weight's home dtype's bytes and its quantization state's
    # (Note [quantized frozen weights] in partition/quantized.py); else None and 0.
    itemsize: int | None = None
    side_bytes: int = 0
    state: Tier | None = Tier.HOST  # where its optimizer state lives (None: frozen): set by the placement


@dataclass
class Built:
    """shards, their context, and the swap stores (Note [one store per thread]):
    ctx.param_store    NVMe parameter homes, for the compute thread's reads
    state_store        NVMe optimizer state, for the optimizer
    param_writer       NVMe parameter homes, for the optimizer's writes of new values
    """

    shards: list[Shard]
    ctx: ShardContext
    state_store: object | None
    param_writer: ParamStore | None = None
    # shard.index -> (weights key or None, build-time shard or None); absent: from the parameter
    _sources: dict = field(default_factory=dict)
    _plan: object = None
    placed: list[Shard] = field(default_factory=list)  # homed, master taken (Note [an interrupted initialize])
    pin_home: Callable[[Shard], None] | None = None  # pins a host home when the budget allows
    placement: Placement | None = None  # every home and state tier (Note [automatic placement])

    def place(self, take_master: Callable[[Shard, torch.Tensor], None]) -> None:
        """Moves every parameter home, in order, one at a time: take_master(shard,
        fp32 partition of its initial value) runs before the next moves (the
        optimizer's init_state). Then waits for the writes to reach the disk.

        Note [an interrupted initialize]: a shard whose move fails (a full disk,
        Ctrl-C) gets its own tensor back here; those in `placed` have their
        master, the original value in fp32, and Engine._abort gives it back in
        the original dtype (exact: the engine's parameters are at most fp32);
        the ones not reached were never touched. So the model the caller still
        holds has its original values and dtypes, never the compute-dtype copy;
        but for frozen parameters, which have no master (Note [frozen parameters]
        in offload/placement.py): theirs is the home's compute-dtype value, exact
        where the model was given in the compute dtype (a bf16 base for a bf16 run)."""
        for shard in self.shards:
            original = shard.param.data
            try:
                part = self._initial_partition(shard)
                if shard.trainable:  # a frozen shard has no master (Note [frozen parameters])
                    take_master(shard, part)
            except BaseException:
                shard.param.data = original
                raise
            self.placed.append(shard)
        self._finish()

    def _initial_partition(self, shard: Shard) -> torch.Tensor | None:
        """Moves the parameter home and returns this rank's fp32 partition of its value
        (None for a frozen shard: nothing takes it)."""
        key, built = self._sources.get(shard.index, (None, None))
        part = None
        if key is None and built is not None:
            part = _adopt_built(shard, built)
        else:
            if built is not None:  # the weights replace what offload.init built
                discard_home(built)
            value = (self._plan.load(key, shard.original_dtype) if key is not None
                     else shard.param.detach())
            if shard.trainable:
                part = shard.my_slice(value.reshape(-1).to(torch.float32)).clone()
            shard.adopt(value)
        if shard.home is Tier.HOST and self.pin_home is not None and not shard.pinned_home:
            self.pin_home(shard)  # offload.init's homes too
        if shard.trainable and not shard.ctx.lazy_grads:
            shard.gradient.allocate()
        return part

    def stores(self) -> list:
        """Each distinct SwapStore once."""
        reader = self.ctx.param_store
        found = [reader and reader.store, self.state_store, self.param_writer and self.param_writer.store]
        return list({id(x): x for x in found if x is not None}.values())

    def _finish(self) -> None:
        for store in self.stores():
            store.wait_all()
            store.trim()  # the first writes were staged; later transfers are mostly direct
        if self._plan is not None:
            self._plan.source.close()


def _adopt_built(shard: Shard, built: Shard) -> torch.Tensor | None:
    """The fp32 partition of a shard homed by offload.init (None where it is frozen and
    stays as built); re-homed in the compute dtype if it differs."""
    if shard is built and not shard.trainable:
        return None  # nothing to read: no master takes it
    if built.home is Tier.HOST:
        part = built.host_part  # no copy: the optimizer copies it, or aliases it as the master
    else:
        part = torch.empty(built.part_numel, dtype=built.dtype)
        built.ctx.param_store.read_part(built, part).wait()
    if shard is not built:  # compute dtype differs from the dtype it was built in
        discard_home(built)
        shard.adopt_partition(part)
    return part.to(torch.float32) if shard.trainable else None


def discard_home(shard: Shard) -> None:
    """Forgets a shard's home bytes (its NVMe file is left for a shard of the same index to overwrite)."""
    nbytes = shard.part_numel * shard.dtype.itemsize
    if shard.home is Tier.HOST:
        pinned = shard.ctx.account.pinned
        if pinned is not None and shard.host_part is not None and shard.pinned_home:
            pinned.credit(nbytes)  # pinned by _home_pinner: off the pinned budget and the host tier
        else:
            shard.ctx.account.credit(Tier.HOST, nbytes)
        shard.host_part = None
    elif shard.home is Tier.NVME:
        shard.ctx.account.credit(Tier.NVME, nbytes)


def _check_dtype(name: str, p: torch.nn.Parameter) -> None:
    check_quantized(name, p)
    if not p.is_floating_point() and quantized_kind(p) is None:
        raise TypeError(f"parameter {name} has dtype {p.dtype}; offload trains floating-point parameters")
    if p.device.type == "meta":
        raise ValueError(f"parameter {name} is on the meta device: pass its values with "
                         "offload.initialize(model, config, weights=...) (or build the model "
                         "inside offload.init)")


def _owners(model: torch.nn.Module, attr: str) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(tensor) -> every (module, local name) holding it (tied tensors have several)."""
    out: dict[int, list] = {}
    for mod in model.modules():
        for local, t in getattr(mod, attr).items():
            if t is not None:
                out.setdefault(id(t), []).append((mod, local))
    return out


def build_shards(model: torch.nn.Module, config: Config, *, layer: DeviceLayer, pg: ProcessGroupInfo,
                 account: MemoryAccount, timeline, run_dirs: RunDirectories, builder=None,
                 weights=None, compiled=(), paged: list | None = None) -> Built:
    """Every parameter's shard, its home decided and nothing moved yet (`Built.place` moves them).

    timeline: an offload.timeline.Timeline the parameter reads are recorded on;
    builder: an offload.init ModelBuilder whose homed shards are adopted;
    weights: anything offload.engine.weights.open_weights takes;
    layer: the engine's device layer; its device is where compute runs;
    compiled: the blocks the config compiles, each gathered whole (Note [compiled blocks]);
    paged: where the quantized layers given their paged class are recorded (for teardown).
    In stages, each named: check what was given, list the parameters, plan them
    within the budgets, take the model over, open what the shards share, make them."""
    plan = None
    if weights is not None:
        from offload.engine.weights import WeightPlan, open_weights

        plan = WeightPlan.check(model, open_weights(weights))
    adopted = builder.shard_of if builder is not None else {}
    named = list(model.named_parameters(remove_duplicate=True))
    check_layers(model)  # a quantized weight only where its layer can be paged
    if config.frozen.quantize is not None and builder is None:
        check_quantized_base(model, config.frozen)
    paged = paged if paged is not None else []
    _check_given(model, named, plan, adopted)
    planned, sources, replacements = _list_parameters(named, config, layer, pg, plan, adopted, builder)
    placement, configs, staging, notes = _plan_within_budgets(model, named, planned, config, layer, pg, builder,
                                                              compiled)
    for pl in planned:
        # A build-time shard is kept as it is where it already sits at its planned
        # home in the compute dtype, and no weights replace it.
        pl.reuse = (pl.built is not None and sources[pl.index][0] is None and pl.built.home is pl.home
                    and pl.built.dtype == (pl.param.dtype if pl.itemsize is not None else config.precision.dtype))
    account.budget_notes.update(notes)
    check_free_space(configs, pg)  # before anything is written or moved, with this host's other ranks
    _take_over(model, planned, replacements, plan, config, layer, account, builder, run_dirs, paged)
    ctx, param_writer, state_store, pinned, pin = _open_shared(planned, placement, configs, staging, config,
                                                               layer, pg, account, timeline, run_dirs, builder)
    return Built(_make_shards(planned, ctx, config.precision.dtype), ctx, state_store, param_writer,
                 _sources=sources, _plan=plan, pin_home=_home_pinner(pinned, layer) if pin else None,
                 placement=placement)


def _check_given(model: torch.nn.Module, named, plan, adopted: dict) -> None:
    """Each parameter's dtype (the weights' where they replace it), and no meta buffer without a value."""
    for name, p in named:
        if id(p) in adopted:
            continue
        if plan is not None and id(p) in plan.param_key:
            if not p.is_floating_point():
                _check_dtype(name, p)
            continue
        _check_dtype(name, p)
    for buf_name, buf in model.named_buffers():
        if buf.device.type == "meta" and (plan is None or buf_name not in plan.buffer_key):
            raise ValueError(f"buffer {buf_name} is on the meta device: pass its value in "
                             "offload.initialize(model, config, weights=...)")


def _list_parameters(named, config: Config, layer: DeviceLayer, pg: ProcessGroupInfo, plan, adopted: dict,
                     builder) -> tuple[list[_Planned], dict, dict]:
    """(each parameter's _Planned, where each initial value comes from by index, the meta
    parameters' placeholders by id). Nothing moves; placeholders are installed once the
    budgets are known to hold."""
    policy = builder.policy if builder is not None else HomePolicy(config)
    auto_homes = config.zero_optimization.offload_param.auto
    next_index = builder.next_index if builder is not None else 0
    planned: list[_Planned] = []
    sources, replacements = {}, {}
    for name, p in named:
        key = plan.param_key.get(id(p)) if plan is not None else None
        built = adopted.get(id(p))
        if built is not None:
            built.name = name
            # Under "auto" the plan, made now the whole model is known, may move it.
            index, home = built.index, None if auto_homes else built.home
            sources[index] = (key, built)
        else:
            if p.device.type == "meta":
                new = torch.nn.Parameter(torch.zeros(1, dtype=p.dtype, device=layer.device).expand(p.shape),
                                         requires_grad=p.requires_grad)
                replacements[id(p)] = new
                p = new
            index, home = next_index, None if auto_homes else policy.home_of(p)
            next_index += 1
            if key is not None:
                sources[index] = (key, None)
        part = partition_numel(p.numel(), pg.world_size)
        quantized = quantized_kind(p) is not None
        planned.append(_Planned(index, name, p, home, part, part * pg.world_size, built,
                                trainable=p.requires_grad, itemsize=p.element_size() if quantized else None,
                                side_bytes=state_bytes(p) if quantized else 0))
    return planned, sources, replacements


def _plan_within_budgets(model, named, planned: list[_Planned], config: Config, layer: DeviceLayer,
                         pg: ProcessGroupInfo, builder, compiled) -> tuple[Placement, dict, tuple | None, dict]:
    """Every home and state tier planned (Note [automatic placement]); with what the engine
    holds beside them, checked against the budgets: (placement, store configs, staging
    plan, the budgets' notes). An auto plan that left too little room is made again."""
    zero = config.zero_optimization
    threshold = zero.stage3_param_persistence_threshold
    apart, ranks = layer.separate_memory, pg.world_size
    placement = budgets.plan(planned, config, layer, pg, threshold=threshold,
                             host=builder.auto_host if builder is not None else None)

    def reserve_of(_placement) -> Reserve:  # budgets.plan set each of `planned`'s tiers
        return reserve(planned, config, separate_memory=apart, world_size=ranks, rank=pg.rank,
                       have_param_store=builder is not None and builder.store is not None,
                       on_demand=budgets.largest_module_group(model, named, planned, apart, ranks),
                       unit=budgets.gathered_by_blocks(compiled, named, planned, apart, ranks))

    first = placement.budgets
    placement, held = settle_plan(
        placement, config, lambda within: budgets.plan(planned, config, layer, pg, threshold=threshold,
                                                       within=within), reserve_of)
    configs, staging, need = held.configs, held.staging, held.need
    if first is not None:
        placement = dataclasses.replace(placement, host_limit=first.host)
    return placement, configs, staging, budgets.check_needs(need, config, pg)


def _take_over(model, planned: list[_Planned], replacements: dict, plan, config: Config, layer: DeviceLayer,
               account: MemoryAccount, builder, run_dirs: RunDirectories, paged: list) -> None:
    """The model becomes the engine's: offload.init's builder hands its shards over, meta
    parameters get their placeholders, buffers their values and device."""
    if builder is not None:
        builder.hand_over(keep={id(pl.param) for pl in planned}, run_dirs=run_dirs)
    if replacements:
        for pid, places in _owners(model, "_parameters").items():
            for mod, local in places:
                if pid in replacements:
                    mod._parameters[local] = replacements[pid]
    _set_buffers(model, plan, config.precision.dtype, layer.device)
    # Quantized layers compute through the engine's gathers, their state whole beside
    # compute (Note [quantized frozen weights] in partition/quantized.py).
    paged.extend(page_modules(model, {id(pl.param) for pl in planned if pl.itemsize is not None}, layer.device))
    for pl in planned:
        if pl.side_bytes:
            account.charge(Tier.DEVICE if layer.separate_memory else Tier.HOST, pl.side_bytes,
                           f"quantization state of {pl.name}")


def _open_shared(planned: list[_Planned], placement: Placement, configs: dict, staging, config: Config,
                 layer: DeviceLayer, pg: ProcessGroupInfo, account: MemoryAccount, timeline,
                 run_dirs: RunDirectories, builder):
    """What the shards share, opened: the swap stores, the pinned ledger and pools, the
    gathered-buffer cache, the ShardContext. Returns (ctx, the parameter writer, the
    state store, the pinned ledger, whether host buffers are pinned)."""
    zero = config.zero_optimization
    dtype = config.precision.dtype
    stores = {role: open_store(c, account, run_dirs) for role, c in configs.items()}
    pinned = account.pinned = PinnedLedger(account.ledger(Tier.HOST), config.memory.pinned_budget)
    # Pinned: buffers that feed a device with memory of its own (page-locked on cuda,
    # tracked as pinned by the simulator: Note [device layer]).
    pin = pins(cuda=layer.separate_memory, pin_memory=zero.offload_param.pin_memory)
    param_store = param_writer = staging_pool = None
    if staging:
        buffer_bytes, depth = staging
        staging_pool = BufferPool(buffer_bytes * depth, pin=pin and layer.page_locks, buffer_bytes=buffer_bytes,
                                  ledger=pinned if pin else account.ledger(Tier.HOST),
                                  what="parameter staging buffer" + (" (pinned)" if pin else ""),
                                  register=layer.register_pinned if pin else None)
        staging_pool.fill()
    if any(pl.home is Tier.NVME for pl in planned):
        have_param_store = builder is not None and builder.store is not None
        param_store = ParamStore(builder.store if have_param_store else stores["param"], pg, timeline,
                                 staging=staging_pool)
        param_writer = ParamStore(stores.get("writer") or stores["state"], pg, timeline)
    gathered = [pl.padded_numel * (pl.itemsize or dtype.itemsize) for pl in planned
                if budgets.gathers_to_a_buffer(pl, layer.separate_memory, pg.world_size)]
    gathered_buffers = None
    if gathered:
        # Gathered buffers reused across steps: about as many as are live at once (a
        # zero-copy host home needs none: Note [zero-copy gather] in partition/shard.py).
        gathered_buffers = BufferCache(3 * max(gathered),
                              charge=lambda n: account.charge(Tier.HOST, n, "idle gathered buffers"),
                              credit=lambda n: account.credit(Tier.HOST, n))
    ctx = shard_context(config, layer, pg, account, param_store=param_store, gathered_buffers=gathered_buffers,
                        lazy_grads=budgets.lazy_gradients(config, placement.state_tiers,
                                                          separate_memory=layer.separate_memory))
    device_homes = [pl.padded_numel * (pl.itemsize or dtype.itemsize) for pl in planned if pl.home is Tier.DEVICE]
    if ctx.streams is not None and device_homes and pin:
        # Device homes' new values go up through pinned buffers (Note [copy streams]).
        ctx.streams.make_upload_pool(max(device_homes), ledger=pinned, pin=layer.page_locks)
    return ctx, param_writer, stores.get("state"), pinned, pin


def _make_shards(planned: list[_Planned], ctx: ShardContext, dtype: torch.dtype) -> list[Shard]:
    shards = []
    for pl in planned:
        if pl.reuse:
            # The build-time shard as it is, now in the engine's context (same
            # device, ranks and account; the engine's stores and gradient tier).
            pl.built.join(ctx)
            shards.append(pl.built)
        else:
            # A quantized weight keeps its packed dtype (Note [quantized frozen weights]).
            own = pl.param.dtype if pl.itemsize is not None else dtype
            shards.append(Shard(pl.index, pl.name, pl.param, compute_dtype=own, home=pl.home, ctx=ctx))
        shards[-1].trainable = pl.trainable
        if pl.trainable:
            shards[-1].gradient.tier = grad_tier_of(pl.state)  # beside its optimizer state
    return shards


def _home_pinner(pinned: PinnedLedger, layer: DeviceLayer) -> Callable[[Shard], None]:
    """Pins a host home (already charged to the host tier) while it fits memory.pinned_budget."""
    def pin_home(shard: Shard) -> None:
        nbytes = shard.part_numel * shard.dtype.itemsize
        if pin_host_home(nbytes, cuda=True, pin_memory=True, pinned_committed=pinned.now,
                         pinned_budget=pinned.budget):
            pinned.charge(nbytes, f"pinned host home of {shard.name}", host_charged=True)
            if layer.page_locks:
                shard.host_part = shard.host_part.pin_memory()
            shard.pinned_home = True  # its copy-in is asynchronous (Shard._host_copy_source)
    return pin_home


def _set_buffers(model: torch.nn.Module, plan, dtype: torch.dtype, device: torch.device) -> None:
    """Buffers to the device in the compute dtype (floating ones); values from the weights where given."""
    owners = _owners(model, "_buffers")
    for buf_name, buf in model.named_buffers():
        target = dtype if buf.is_floating_point() else buf.dtype
        if plan is not None and buf_name in plan.buffer_key:
            value = plan.load(plan.buffer_key[buf_name], buf.dtype).to(device, target)
            for mod, local in owners[id(buf)]:
                mod._buffers[local] = value
        else:
            buf.data = buf.data.to(device, target)
