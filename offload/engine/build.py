"""Turns a model's parameters into shards at their home tiers, at initialize.

Parameters are taken one at a time (their original fp32 values become the
optimizer's masters, their compute-dtype copies go home), so building never
holds a second copy of the whole model.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from offload.config import Config
from offload.partition.accounting import Tier
from offload.partition.shard import HomeKind, Shard, ShardContext


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

    def initial_partition(self, shard: Shard) -> torch.Tensor:
        """Moves the parameter home and returns this rank's fp32 partition of its value."""
        value = shard.param.detach()
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


def _check_dtype(name: str, p: torch.nn.Parameter) -> None:
    if not p.is_floating_point():
        raise TypeError(f"parameter {name} has dtype {p.dtype}; offload trains floating-point parameters")
    if p.device.type == "meta":
        raise ValueError(f"parameter {name} is on the meta device: load its values before "
                         "offload.initialize (or build the model inside offload.init)")


def build_shards(model: torch.nn.Module, config: Config, ctx: ShardContext, dtype: torch.dtype,
                 param_tier: Tier, optim_tier: Tier, created_dirs: list[str]) -> Built:
    zero = config.zero_optimization
    threshold = zero.stage3_param_persistence_threshold
    named = list(model.named_parameters(remove_duplicate=True))
    # offload_param.max_in_cpu (DeepSpeed's meaning): with NVMe offload, keep
    # the first parameters, up to this many elements, in host memory instead.
    in_cpu_left = zero.offload_param.max_in_cpu or 0
    shards = []
    for index, (name, p) in enumerate(named):
        _check_dtype(name, p)
        if param_tier is Tier.DEVICE or p.numel() <= threshold:
            home = HomeKind.DEVICE
        elif param_tier is Tier.HOST:
            home = HomeKind.HOST
        elif p.numel() <= in_cpu_left:
            home = HomeKind.HOST
            in_cpu_left -= p.numel()
        else:
            home = HomeKind.NVME
        shards.append(Shard(index, name, p, compute_dtype=dtype, home=home, ctx=ctx))

    # Note [one store per thread]
    # A SwapStore is driven by one thread (it finishes transfers in submission
    # order). The compute thread reads parameters while the optimizer thread
    # reads and writes state and writes new parameter values (Note [optimizer
    # overlap]), so each gets its own stores, over the same files: the
    # optimizer writes a parameter's file only after its gradient is final,
    # and the compute thread reads it again only after step() has waited.
    from offload.partition.nvme_home import ParamStore

    nvme_shards = [s for s in shards if s.home is HomeKind.NVME]
    param_path = os.fspath(zero.offload_param.nvme_path) if nvme_shards else None
    state_path = os.fspath(zero.offload_optimizer.nvme_path) if optim_tier is Tier.NVME else None
    configs = {}
    if nvme_shards:
        op = zero.offload_param
        staging = op.buffer_count * op.buffer_size * dtype.itemsize if op.buffer_count and op.buffer_size else None
        configs["param"] = _swap_config(param_path, [s.part_numel * dtype.itemsize for s in nvme_shards],
                                        staging, config, ctx)
    if state_path is not None:
        oo = zero.offload_optimizer
        staging = oo.buffer_count * max(s.part_numel for s in shards) * 4 if oo.buffer_count else None
        configs["state"] = _swap_config(state_path, [3 * s.part_numel * 4 for s in shards], staging, config, ctx)
    if nvme_shards and state_path != param_path:
        configs["writer"] = _swap_config(param_path, [], None, config, ctx)
    _preflight_budgets(shards, config, dtype, optim_tier, ctx, sum(c.buffer_bytes for c in configs.values()))
    for buf_name, buf in model.named_buffers():
        target = dtype if buf.is_floating_point() else buf.dtype
        buf.data = buf.data.to(ctx.device, target)

    stores = {role: _open_store(c, ctx, created_dirs) for role, c in configs.items()}
    param_store = state_store = param_writer = None
    if nvme_shards:
        param_store = ParamStore(stores["param"], ctx.pg, ctx.timeline)
        ctx.param_store = param_store
        param_writer = ParamStore(stores.get("writer") or stores["state"], ctx.pg, ctx.timeline)
    state_store = stores.get("state")
    return Built(shards, param_store, state_store, param_writer)


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
                                         aio=_aio_config(config), atomic=False)
    if staging_bytes is None:
        staging_bytes = min(swap_config.buffer_bytes, 32 << 20)
    swap_config = dataclasses.replace(swap_config, buffer_bytes=max(staging_bytes, 2 * ALIGN))
    return swap_config


def _open_store(swap_config, ctx: ShardContext, created_dirs: list[str]):
    from offload.aio.swap_store import SwapStore
    from offload.engine.memory import TierLedger

    rank_dir = _rank_dir(swap_config.nvme_path, ctx.pg.rank)
    if not os.path.exists(rank_dir):
        created_dirs.append(rank_dir)
    return SwapStore(swap_config, ledger=TierLedger(ctx.account, Tier.HOST))


def _aio_config(config: Config):
    from offload.aio import AioConfig

    a = config.aio
    return AioConfig(block_size=a.block_size, queue_depth=a.queue_depth,
                     intra_op_parallelism=a.intra_op_parallelism)
