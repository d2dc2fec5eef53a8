"""Turns a model's parameters into shards at their home tiers, at initialize.

Parameters are taken one at a time (their original fp32 values become the
optimizer's masters, their compute-dtype copies go home), so building never
holds a second copy of the whole model. Each shard's initial value comes from
one of three places (`Built.initial_partition`):
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
import os
from dataclasses import dataclass, field

import torch

from offload.config import Config
from offload.partition.accounting import Tier
from offload.partition.shard import HomeKind, Shard, ShardContext


class HomePolicy:
    """Where a parameter lives: the device when offload_param is none or it is
    under stage3_param_persistence_threshold elements, else host or NVMe."""

    def __init__(self, config: Config, param_tier: Tier):
        zero = config.zero_optimization
        self.param_tier = param_tier
        self.threshold = zero.stage3_param_persistence_threshold
        # offload_param.max_in_cpu (DeepSpeed's meaning): with NVMe offload, keep
        # the first parameters, up to this many elements, in host memory instead.
        self.in_cpu_left = zero.offload_param.max_in_cpu or 0

    def home_of(self, p: torch.Tensor) -> HomeKind:
        if self.param_tier is Tier.DEVICE or p.numel() <= self.threshold:
            return HomeKind.DEVICE
        if self.param_tier is Tier.HOST:
            return HomeKind.HOST
        if p.numel() <= self.in_cpu_left:
            self.in_cpu_left -= p.numel()
            return HomeKind.HOST
        return HomeKind.NVME


@dataclass
class Built:
    """shards, and the swap stores (Note [one store per thread]):
    param_store        NVMe parameter homes, for the compute thread's reads
    state_store        NVMe optimizer state, for the optimizer
    param_writer       NVMe parameter homes, for the optimizer's writes of new values
    """

    shards: list[Shard]
    param_store: object | None
    state_store: object | None
    param_writer: object | None = None
    # shard.index -> (weights key or None, build-time shard or None); absent: from the parameter
    _sources: dict = field(default_factory=dict)
    _plan: object = None

    def initial_partition(self, shard: Shard) -> torch.Tensor:
        """Moves the parameter home and returns this rank's fp32 partition of its value."""
        key, built = self._sources.get(shard.index, (None, None))
        if key is None and built is not None:
            part = _adopt_built(shard, built)
        else:
            if built is not None:  # the weights replace what offload.init built
                discard_home(built)
            value = (self._plan.load(key, shard.original_dtype) if key is not None
                     else shard.param.detach())
            fp32 = value.reshape(-1).to(torch.float32)
            part = shard.my_slice(fp32).clone()
            shard.adopt(value)
        if not shard.ctx.lazy_grads:
            shard.allocate_grad_part()
        return part

    def stores(self) -> list:
        """Each distinct SwapStore once."""
        found = [self.param_store and self.param_store.store, self.state_store,
                 self.param_writer and self.param_writer.store]
        return list({id(x): x for x in found if x is not None}.values())

    def finish(self) -> None:
        for store in self.stores():
            store.wait_all()
            store.trim()  # the first writes were staged; later transfers are mostly direct
        if self._plan is not None:
            self._plan.source.close()


def _adopt_built(shard: Shard, built: Shard) -> torch.Tensor:
    """The fp32 partition of a shard homed by offload.init; re-homed in the compute dtype if it differs."""
    if built.home is HomeKind.HOST:
        part = built.host_part  # no copy: the optimizer copies it, or aliases it as the master
    else:
        part = torch.empty(built.part_numel, dtype=built.dtype)
        built.ctx.param_store.read_part(built, part).wait()
    if shard is not built:  # compute dtype differs from the dtype it was built in
        discard_home(built)
        shard.adopt_partition(part)
    return part.to(torch.float32)


def discard_home(shard: Shard) -> None:
    """Forgets a shard's home bytes (its NVMe file is left for a shard of the same index to overwrite)."""
    nbytes = shard.part_numel * shard.dtype.itemsize
    if shard.home is HomeKind.HOST:
        shard.ctx.account.credit(Tier.HOST, nbytes)
        shard.host_part = None
    elif shard.home is HomeKind.NVME:
        shard.ctx.account.credit(Tier.NVME, nbytes)


def _check_dtype(name: str, p: torch.nn.Parameter) -> None:
    if not p.is_floating_point():
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


def build_shards(model: torch.nn.Module, config: Config, ctx: ShardContext, dtype: torch.dtype,
                 param_tier: Tier, optim_tier: Tier, created_dirs: list[str], *,
                 builder=None, weights=None) -> Built:
    """builder: an offload.init ModelBuilder whose homed shards are adopted;
    weights: anything offload.engine.weights.open_weights takes."""
    zero = config.zero_optimization
    plan = None
    if weights is not None:
        from offload.engine.weights import WeightPlan, open_weights

        plan = WeightPlan.check(model, open_weights(weights))
    adopted = builder.shard_of if builder is not None else {}
    named = list(model.named_parameters(remove_duplicate=True))
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

    # Nothing has moved yet. Meta parameters get placeholder parameters,
    # installed in their modules once the budgets are known to hold.
    policy = builder.policy if builder is not None else HomePolicy(config, param_tier)
    next_index = builder.next_index if builder is not None else 0
    shards, sources, replacements = [], {}, {}
    for name, p in named:
        key = plan.param_key.get(id(p)) if plan is not None else None
        built = adopted.get(id(p))
        if built is not None:
            built.name = name
            shard = built
            if key is not None or built.dtype != dtype:
                shard = Shard(built.index, name, p, compute_dtype=dtype, home=built.home, ctx=ctx)
            sources[shard.index] = (key, built)
        else:
            if p.device.type == "meta":
                new = torch.nn.Parameter(torch.zeros(1, dtype=p.dtype, device=ctx.device).expand(p.shape),
                                         requires_grad=p.requires_grad)
                replacements[id(p)] = new
                p = new
            shard = Shard(next_index, name, p, compute_dtype=dtype, home=policy.home_of(p), ctx=ctx)
            next_index += 1
            if key is not None:
                sources[shard.index] = (key, None)
        shards.append(shard)

    # Note [one store per thread]
    # A SwapStore is driven by one thread (it finishes transfers in submission
    # order). The compute thread reads parameters while the optimizer thread
    # reads and writes state and writes new parameter values (Note [optimizer
    # overlap]), so each gets its own stores, over the same files: the
    # optimizer writes a parameter's file only after its gradient is final,
    # and the compute thread reads it again only after step() has waited.
    # A model built under offload.init brings its parameter store along.
    nvme_shards = [s for s in shards if s.home is HomeKind.NVME]
    param_path = os.fspath(zero.offload_param.nvme_path) if nvme_shards else None
    state_path = os.fspath(zero.offload_optimizer.nvme_path) if optim_tier is Tier.NVME else None
    have_param_store = builder is not None and builder.store is not None
    configs = {}
    if nvme_shards and not have_param_store:
        op = zero.offload_param
        staging = op.buffer_count * op.buffer_size * dtype.itemsize if op.buffer_count and op.buffer_size else None
        configs["param"] = _swap_config(param_path, [s.part_numel * dtype.itemsize for s in nvme_shards],
                                        staging, config, ctx)
    if state_path is not None:
        oo = zero.offload_optimizer
        staging = oo.buffer_count * max(s.part_numel for s in shards) * 4 if oo.buffer_count else None
        configs["state"] = _swap_config(state_path, [3 * s.part_numel * 4 for s in shards], staging, config, ctx)
    if nvme_shards and state_path != param_path:
        # Writes the same files as the parameter store, which holds their disk
        # space: no capacity of its own, but the same staging budget. Sized from
        # no tensors it had 8 KiB, and a new value not aligned for a direct
        # write went through in 4 KiB pieces (GPT 67M, optimizer state on the
        # host: a 7 s step).
        writer = _swap_config(param_path, [s.part_numel * dtype.itemsize for s in nvme_shards], None,
                              config, ctx)
        configs["writer"] = dataclasses.replace(writer, capacity_bytes=0)
    _preflight_budgets(shards, config, dtype, optim_tier, ctx, sum(c.buffer_bytes for c in configs.values()))
    if builder is not None:
        builder.hand_over(keep={id(s.param) for s in shards}, created_dirs=created_dirs)
    if replacements:
        for pid, places in _owners(model, "_parameters").items():
            for mod, local in places:
                if pid in replacements:
                    mod._parameters[local] = replacements[pid]
    _set_buffers(model, plan, dtype, ctx)

    from offload.partition.nvme_home import ParamStore

    stores = {role: _open_store(c, ctx, created_dirs) for role, c in configs.items()}
    param_store = param_writer = None
    if nvme_shards:
        if ctx.param_store is None:
            ctx.param_store = ParamStore(stores["param"], ctx.pg)
        ctx.param_store.timeline = ctx.timeline
        param_store = ctx.param_store
        param_writer = ParamStore(stores.get("writer") or stores["state"], ctx.pg, ctx.timeline)
    return Built(shards, param_store, stores.get("state"), param_writer, _sources=sources, _plan=plan)


def _set_buffers(model: torch.nn.Module, plan, dtype: torch.dtype, ctx: ShardContext) -> None:
    """Buffers to the device in the compute dtype (floating ones); values from the weights where given."""
    owners = _owners(model, "_buffers")
    for buf_name, buf in model.named_buffers():
        target = dtype if buf.is_floating_point() else buf.dtype
        if plan is not None and buf_name in plan.buffer_key:
            value = plan.load(plan.buffer_key[buf_name], buf.dtype).to(ctx.device, target)
            for mod, local in owners[id(buf)]:
                mod._buffers[local] = value
        else:
            buf.data = buf.data.to(ctx.device, target)


def _preflight_budgets(shards: list[Shard], config: Config, dtype: torch.dtype, optim_tier: Tier,
                       ctx: ShardContext, staging_bytes: int = 0) -> None:
    """Refuses, before any parameter moves, a configuration whose budgets cannot hold it.

    staging_bytes: the swap stores' host staging budgets (charged to the host
    tier as their buffer pools allocate)."""
    need = {Tier.DEVICE: {}, Tier.HOST: {}}
    if staging_bytes:
        need[Tier.HOST]["swap staging buffers"] = staging_bytes

    def add(tier, what, nbytes):
        if tier in need:
            need[tier][what] = need[tier].get(what, 0) + nbytes

    for s in shards:
        home_bytes = s.padded_numel * dtype.itemsize if s.home is HomeKind.DEVICE else s.part_numel * dtype.itemsize
        add({HomeKind.DEVICE: Tier.DEVICE, HomeKind.HOST: Tier.HOST}.get(s.home), "parameters", home_bytes)
        grad_tier = Tier.DEVICE if optim_tier is Tier.DEVICE else Tier.HOST
        add(grad_tier, "fp32 gradients", s.part_numel * 4)
        add(optim_tier, "optimizer state", 3 * s.part_numel * 4)
    offloaded = [s for s in shards if s.home is not HomeKind.DEVICE]
    if offloaded:
        largest = max(s.padded_numel for s in offloaded) * dtype.itemsize
        add(Tier.DEVICE, "working set (largest offloaded parameter)", largest)
    budgets = {Tier.DEVICE: config.memory.device_budget, Tier.HOST: config.memory.host_budget}
    for tier, parts in need.items():
        budget, total = budgets[tier], sum(parts.values())
        if budget is not None and total > budget:
            detail = ", ".join(f"{what} {n}" for what, n in parts.items())
            raise MemoryError(
                f"{tier.value} tier budget exceeded: this configuration needs at least {total} bytes "
                f"on the {tier.value} tier ({detail}) but memory.{tier.value}_budget is {budget}; "
                f"raise the budget or offload more (zero_optimization.offload_param / offload_optimizer)")


def _rank_dir(nvme_path, rank: int) -> str:
    return os.path.join(os.fspath(nvme_path), f"rank{rank}")


def _swap_config(nvme_path, sizes, staging_bytes, config, ctx):
    """A store's settings. staging_bytes: the host staging budget from DeepSpeed's
    keys (offload_param.buffer_count x buffer_size elements, offload_optimizer.
    buffer_count x the largest state partition): the same budgets, except that a
    tensor larger than the budget streams through it in pieces instead of
    failing ("More elements than buffer size"). None: sized from the model, two
    of the largest files up to 32 MiB: the engine's own transfers are aligned
    and skip staging (Note [direct transfers]); staging carries headers, small
    tensors and the first write of each parameter."""
    from offload.aio._memory import ALIGN
    from offload.aio.swap_store import SwapConfig

    # atomic=False: swap files are scratch, written and read back by this
    # process and removed at close; overwriting in place skips a rename and a
    # block reallocation per write (9 ms each on ext4, measured).
    swap_config = SwapConfig.for_tensors(nvme_path, sizes, in_flight=2, rank=ctx.pg.rank,
                                         aio=config.aio, atomic=False)
    if staging_bytes is None:
        staging_bytes = min(swap_config.buffer_bytes, 8 << 20)
    swap_config = dataclasses.replace(swap_config, buffer_bytes=max(staging_bytes, 2 * ALIGN))
    return swap_config


def _open_store(swap_config, ctx: ShardContext, created_dirs: list[str]):
    from offload.aio.swap_store import SwapStore
    from offload.engine.memory import TierLedger

    rank_dir = _rank_dir(swap_config.nvme_path, ctx.pg.rank)
    if not os.path.exists(rank_dir):
        created_dirs.append(rank_dir)
    return SwapStore(swap_config, ledger=TierLedger(ctx.account, Tier.HOST))


def _swap_store(nvme_path, sizes, staging_bytes, config, ctx, created_dirs):
    """A store opened at once (offload.init, before the model's size is known)."""
    return _open_store(_swap_config(nvme_path, sizes, staging_bytes, config, ctx), ctx, created_dirs)

