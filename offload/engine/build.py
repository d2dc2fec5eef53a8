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
    shards: list[Shard]
    param_store: object | None
    state_store: object | None
    _grad_device: torch.device = torch.device("cpu")
    _grad_tier: Tier = Tier.HOST
    _account: object = None

    def initial_partition(self, shard: Shard) -> torch.Tensor:
        """Moves the parameter home and returns this rank's fp32 partition of its value."""
        value = shard.param.detach()
        fp32 = value.reshape(-1).to(torch.float32)
        part = shard.my_slice(fp32).clone()
        shard.adopt(value)
        self._account.charge(self._grad_tier, shard.part_numel * 4, f"gradient of {shard.name}")
        shard.grad_part = torch.zeros(shard.part_numel, dtype=torch.float32, device=self._grad_device)
        return part

    def finish(self) -> None:
        for store in {id(x): x for x in (self.param_store and self.param_store.store,
                                          self.state_store) if x is not None}.values():
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

    # NVMe stores: one per directory (parameters and optimizer state may share one).
    wanted: dict[str, list[int]] = {}
    nvme_shards = [s for s in shards if s.home is HomeKind.NVME]
    if nvme_shards:
        wanted.setdefault(os.fspath(zero.offload_param.nvme_path), []).extend(
            s.part_numel * dtype.itemsize for s in nvme_shards)
    if optim_tier is Tier.NVME:
        wanted.setdefault(os.fspath(zero.offload_optimizer.nvme_path), []).extend(
            3 * s.part_numel * 4 for s in shards)
    swap_configs = {path: _swap_config(path, sizes, _staging_bytes(path, config, nvme_shards, shards, dtype,
                                                                   optim_tier), config, ctx)
                    for path, sizes in wanted.items()}
    staging = sum(c.buffer_bytes for c in swap_configs.values())
    _preflight_budgets(shards, config, dtype, optim_tier, ctx, staging)
    for buf_name, buf in model.named_buffers():
        target = dtype if buf.is_floating_point() else buf.dtype
        buf.data = buf.data.to(ctx.device, target)
    stores = {path: _open_store(swap_config, ctx, created_dirs)
              for path, swap_config in swap_configs.items()}
    param_store = state_store = None
    if nvme_shards:
        from offload.partition.nvme_home import ParamStore

        param_store = ParamStore(stores[os.fspath(zero.offload_param.nvme_path)], ctx.pg)
        ctx.param_store = param_store
    if optim_tier is Tier.NVME:
        state_store = stores[os.fspath(zero.offload_optimizer.nvme_path)]
    grad_tier = Tier.DEVICE if optim_tier is Tier.DEVICE else Tier.HOST
    grad_device = ctx.device if grad_tier is Tier.DEVICE else torch.device("cpu")
    return Built(shards, param_store, state_store, _grad_device=grad_device,
                 _grad_tier=grad_tier, _account=ctx.account)


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


def _staging_bytes(path: str, config: Config, nvme_shards, shards, dtype, optim_tier) -> int | None:
    """Host staging bytes a store may use, from DeepSpeed's buffer keys when given.

    offload_param.buffer_count x buffer_size (elements, compute dtype) and
    offload_optimizer.buffer_count x the largest shard's fp32 partition: the
    same budgets DeepSpeed's keys set, except that a tensor larger than the
    budget streams through it in pieces instead of failing ("More elements
    than buffer size"). None: sized from the model (two of the largest files).
    """
    zero = config.zero_optimization
    total = 0
    op = zero.offload_param
    if nvme_shards and os.fspath(op.nvme_path) == path and op.buffer_count and op.buffer_size:
        total += op.buffer_count * op.buffer_size * dtype.itemsize
    oo = zero.offload_optimizer
    if optim_tier is Tier.NVME and os.fspath(oo.nvme_path) == path and oo.buffer_count:
        total += oo.buffer_count * max(s.part_numel for s in shards) * 4
    return total or None


def _swap_config(nvme_path, sizes, staging_bytes, config, ctx):
    from offload.aio.swap_store import SwapConfig

    # atomic=False: swap files are scratch, written and read back by this
    # process and removed at close; overwriting in place skips a rename and a
    # block reallocation per write (9 ms each on ext4, measured).
    swap_config = SwapConfig.for_tensors(nvme_path, sizes, in_flight=2, rank=ctx.pg.rank,
                                         aio=_aio_config(config), atomic=False)
    if staging_bytes is not None:
        from offload.aio._memory import ALIGN

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
