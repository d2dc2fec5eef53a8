"""What the engine itself holds on each budgeted tier, checked before anything
moves (`tier_needs`, checked by `check_needs`): an impossible configuration fails at initialize
with the numbers, and an auto placement is planned within what is left
(Note [automatic placement] in offload/placement.py)."""
from __future__ import annotations

import dataclasses

import torch

from offload.config import Config
from offload.accounting import TierBudgetError
from offload.placement import (DEVICE_SHARE, HOST_SHARE, Budgets, ParamSpec, Placement, nvme_state_buffers,
                               plan_placement, uniform)
from offload.step.update_policy import UpdatePolicy
from offload.tiers import Tier, grad_tier_of
from offload.node import node_share
from offload.partition.prefetch import working_set_elems
from offload.transfers.device_copies import ring_bytes, upload_pool_bytes
from offload.aio.memory import pins


def gathers_to_a_buffer(pl, separate_memory: bool, world_size: int) -> bool:
    """Whether gathering this parameter allocates a device-tier buffer: every
    offloaded home but a host one on a CPU-only single rank (Note [zero-copy
    gather] in offload/partition/shard.py). separate_memory: the device layer's."""
    if pl.home is Tier.DEVICE:
        return False
    return not (pl.home is Tier.HOST and world_size == 1 and not separate_memory)


def largest_module_group(model: torch.nn.Module, named, planned: list, separate_memory: bool,
                          world_size: int) -> int:
    """Elements of the largest set of parameters one module gathers at once (its
    own, held together by its forward pre-hook: Note [when parameters are
    gathered]): the least any step holds."""
    by_id = {id(p): pl for (_, p), pl in zip(named, planned)}
    largest = 0
    for mod in model.modules():
        own = {id(p) for p in mod._parameters.values() if p is not None}
        largest = max(largest, sum(by_id[i].padded_numel for i in own
                                   if i in by_id and gathers_to_a_buffer(by_id[i], separate_memory, world_size)))
    return largest


def gathered_by_blocks(blocks, named, planned: list, separate_memory: bool, world_size: int) -> int:
    """Elements of the largest set of parameters a compiled block gathers at once: all
    under it (Note [compiled blocks]); 0 without blocks."""
    by_id = {id(p): pl for (_, p), pl in zip(named, planned)}
    return max((sum(by_id[id(p)].padded_numel for p in block.parameters() if id(p) in by_id
                    and gathers_to_a_buffer(by_id[id(p)], separate_memory, world_size)) for block in blocks),
               default=0)


def tier_needs(planned: list, config: Config, dtype: torch.dtype,
               staging_bytes: int = 0, *, separate_memory: bool = False,
               world_size: int = 1, on_demand: int = 0, param_staging_bytes: int = 0,
               grad_backlog_elems: int | None = None, unit: int = 0) -> dict[Tier, dict]:
    """Per budgeted tier, {what: bytes} the engine will hold at once. Each of `planned`
    has its home and its optimizer state's tier (`state`). grad_backlog_elems: the
    most gradient elements held at once where gradients live only until their
    overlapped update (`grad_backlog`); None: every gradient partition.

    Device tier: the parameters homed there, and the offloaded ones gathered at
    once: what one module gathers together (on_demand, elements) or the
    prefetcher's live limit if larger, plus its one read ahead
    (`working_set_elems`, Note [prefetch within the device budget]); with
    compiled blocks, each block's whole set (unit, Note [blocks as the unit of
    prefetch]). Host tier:
    homes, fp32 gradients, optimizer state, the swap stores' staging buffers
    (staging_bytes), idle gathered buffers kept for reuse (on a CPU device: the
    BufferCache build.py makes, 3 x the largest parameter gathered into a
    buffer, not a zero-copy host home), beside a device with memory of its own
    the copy streams' buffers (the gradient staging ring, the pinned upload
    buffers of device homes' new values), and with NVMe optimizer state
    what its update keeps in flight (docs/ARCHITECTURE.md, "Memory budget").
    Saved activations are the model's and depend on the inputs: they get what
    the device budget leaves, which the returned line states."""

    need = {Tier.DEVICE: {}, Tier.HOST: {}}
    if staging_bytes:
        need[Tier.HOST]["swap staging buffers"] = staging_bytes
    if param_staging_bytes:
        need[Tier.HOST]["parameter staging buffers"] = param_staging_bytes

    def add(tier, what, nbytes):
        if tier in need and nbytes:
            need[tier][what] = need[tier].get(what, 0) + nbytes

    zero = config.zero_optimization
    for s in planned:
        c = s.itemsize or dtype.itemsize  # a quantized home's own (Note [quantized frozen weights])
        home_bytes = s.padded_numel * c if s.home is Tier.DEVICE else s.part_numel * c
        if s.home is Tier.HOST and s.state is Tier.HOST and dtype == torch.float32:
            home_bytes = 0  # the fp32 host home is the master itself (ShardStates.aliases_home in optim/states.py)
        add(s.home, "parameters", home_bytes)
        # A quantized weight's quantization state, whole beside compute (partition/quantized.py).
        add(Tier.DEVICE if separate_memory else Tier.HOST, "quantization state", s.side_bytes)
        if s.state is None:
            continue  # frozen: its home alone (Note [frozen parameters] in offload/placement.py)
        if grad_backlog_elems is None or s.state is Tier.DEVICE:
            add(grad_tier_of(s.state), "fp32 gradients", s.part_numel * 4)
        add(s.state, "optimizer state", 3 * s.part_numel * 4)
    overlapped = [s.part_numel for s in planned if s.state not in (None, Tier.DEVICE)]
    if grad_backlog_elems is not None and overlapped:
        elems = min(sum(overlapped), grad_backlog_elems)
        add(Tier.HOST, "fp32 gradients awaiting their overlapped update", elems * 4)
    gathered = [s.padded_numel for s in planned if gathers_to_a_buffer(s, separate_memory, world_size)]
    if gathered:
        largest = max(gathered)
        # Prefetching is on where a transfer is read ahead (Shard.reads_ahead).
        reads_ahead = any(s.home is Tier.NVME or (separate_memory and s.home is Tier.HOST) for s in planned)
        working = working_set_elems(zero, gathered, reads_ahead, max(on_demand, largest, unit), unit)
        add(Tier.DEVICE, "offloaded parameters gathered at once (working set)", working * dtype.itemsize)
    if gathered and not separate_memory:  # only gathers into a buffer use them (Note [zero-copy gather])
        add(Tier.HOST, "idle gathered buffers kept for reuse", 3 * max(gathered) * dtype.itemsize)
    if separate_memory:  # the copy streams' own host buffers (transfers/device_copies.py)
        # Gradients go down through the ring unless they stay beside device state; a frozen
        # parameter has none (an unfrozen one grows the ring: engine/unfreeze.py).
        down = [s for s in planned if (grad_tier_of(s.state) if s.state is not None
                                       else zero.offload_optimizer.grad_tier) is not Tier.DEVICE]
        if down:  # the manager makes the ring where any may go down; sized by the trainable
            largest = max((s.part_numel for s in down if s.state is not None), default=1)
            add(Tier.HOST, "gradient staging ring", ring_bytes(largest * 4))
        device_homes = [s.padded_numel * (s.itemsize or dtype.itemsize) for s in planned if s.home is Tier.DEVICE]
        if device_homes and pins(cuda=True, pin_memory=zero.offload_param.pin_memory):
            add(Tier.HOST, "upload staging buffers", upload_pool_bytes(max(device_homes)))
    nvme_state = [s.part_numel for s in planned if s.state is Tier.NVME]
    if nvme_state:
        homes_on_nvme = any(s.home is Tier.NVME for s in planned)
        for what, nbytes in nvme_state_buffers(max(nvme_state), dtype.itemsize, homes_on_nvme).items():
            add(Tier.HOST, what, nbytes)
    return need


def build_reserve(config: Config, largest_part: int, *, separate_memory: bool) -> int:
    """What offload.init keeps of the host budget for the engine's own buffers while it
    builds into the plan (Note [building into the plan] in offload/placement.py): those
    that grow with the largest partition built so far, as initialize will reserve them
    with some state on NVMe. Not the gradients where every one is held (accumulation,
    clipping): they grow with the whole model, unknown yet; initialize moves what
    they leave no room for."""
    dtype = config.precision.dtype
    reserve = sum(nvme_state_buffers(largest_part, dtype.itemsize, homes_on_nvme=True).values())
    reserve += PLAN_SLACK * largest_part
    policy = UpdatePolicy.of(config, separate_memory=separate_memory)
    if policy.updates_free_gradients:
        reserve += policy.backlog_bound(largest_part) * 4
    if not separate_memory:
        reserve += 3 * largest_part * dtype.itemsize  # idle gathered buffers
    return reserve


def _host_remedy(config: Config) -> str:
    """What would take bytes off the host tier, said for this config's offload sections."""
    zero = config.zero_optimization
    sides = (("offload_param", zero.offload_param), ("offload_optimizer", zero.offload_optimizer))
    if not any(section.auto for _, section in sides):
        return "offload more (zero_optimization.offload_param / offload_optimizer)"
    remedies = []
    for key, section in sides:
        if section.auto and section.nvme_path is None:
            remedies.append(f"give zero_optimization.{key} an nvme_path for what the host cannot hold")
        elif not section.auto and section.device is Tier.HOST:
            remedies.append(f"set zero_optimization.{key}.device to 'auto' or 'nvme' (it is 'cpu': all of it "
                            "stays on the host)")
    return "; or ".join(remedies) or "the auto plan already puts on NVMe everything it may"


def check_needs(need: dict[Tier, dict], config: Config, pg=None) -> dict[Tier, str]:
    """Raises MemoryError where a tier's needs exceed its budget; else, per budgeted
    tier, the line saying what was reserved. pg: the shard layout, named in the
    remedy where groups hold copies (Note [hybrid sharding])."""
    budgets = {Tier.DEVICE: config.memory.device_budget, Tier.HOST: config.memory.host_budget}
    notes = {}
    for tier, parts in need.items():
        budget, total = budgets[tier], sum(parts.values())
        if budget is None:
            continue
        detail = ", ".join(f"{what} {n}" for what, n in parts.items()) or "nothing"
        if total > budget:
            change = (_host_remedy(config) if tier is Tier.HOST
                      else "lower zero_optimization.stage3_max_live_parameters (the prefetcher's live limit) "
                           "or stage3_prefetch_bucket_size (0: no prefetch), or offload more")
            if pg is not None and pg.replicas > 1:
                change += (f"; or shard over more ranks: each rank holds 1/{pg.world_size} of the state in shard "
                           f"groups of {pg.world_size} (zero_optimization.shard_group_size), 1/{pg.job_size} with "
                           "'world', whose gathers cross nodes (Note [hybrid sharding])")
            raise TierBudgetError(
                f"{tier.value} tier budget exceeded: this configuration needs at least {total} bytes "
                f"on the {tier.value} tier ({detail}) but memory.{tier.value}_budget is {budget}; "
                f"raise memory.{tier.value}_budget to at least {total}, or {change}")
        notes[tier] = (f"initialize reserved {total} of memory.{tier.value}_budget {budget} bytes ({detail})"
                       + (f", leaving {budget - total} for saved activations; raise "
                          "memory.device_budget or checkpoint activations (activation_checkpointing)"
                          if tier is Tier.DEVICE else ""))
    return notes


def default_host_budget(config: Config, local_ranks: int = 1) -> int:
    """What an auto plan may give homes and state on the host: memory.host_budget
    where set, else HOST_SHARE of the host memory available now, divided among
    the job's ranks on this host (Note [the node's share] in offload/node.py)."""
    import psutil

    mem = config.memory
    if mem.host_budget is not None:
        return mem.host_budget
    return int(HOST_SHARE * psutil.virtual_memory().available) // max(1, local_ranks)


def auto_budgets(config: Config, layer, pg, host: int | None = None) -> Budgets:
    """What an auto plan may give homes and state on each tier (Note [automatic
    placement]): the host gets memory.host_budget where set, else HOST_SHARE of
    the host memory available now; device homes get DEVICE_SHARE of
    memory.device_budget, else of the device's free memory (none where the
    device has no memory of its own or cannot say how much is free): the rest
    is for saved activations and the gathered working set. The smallest over
    ranks, so every rank makes the same plan. host: the host budget taken
    before the model was built (offload.init, Note [building into the plan]);
    None: default_host_budget now."""
    mem = config.memory
    zero = config.zero_optimization
    if host is None:

        host = default_host_budget(config, node_share(pg).local_ranks)
    device = 0
    if layer.separate_memory:
        total = mem.device_budget if mem.device_budget is not None else layer.free_memory()
        device = int(DEVICE_SHARE * total) if total is not None else 0
    if pg.job_size > 1:  # one plan for every rank of the job, every group's copy alike
        both = torch.tensor([float(host), float(device)], dtype=torch.float64, device=layer.device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN, group=pg.job_group)
        host, device = int(both[0].item()), int(both[1].item())
    return Budgets(device=device, host=host,
                   nvme_homes=zero.offload_param.auto and zero.offload_param.nvme_path is not None,
                   nvme_state=zero.offload_optimizer.auto and zero.offload_optimizer.nvme_path is not None)


def plan(planned: list, config: Config, layer, pg, *, threshold: int, within: Budgets | None = None,
         host: int | None = None) -> Placement:
    """Every home and optimizer state tier of `planned` (set on each): the auto plan
    where a side is "auto" (within `within`, default `auto_budgets(..., host)`), else
    the config's tiers, as HomePolicy already decided the homes."""
    zero = config.zero_optimization
    param, optimizer = zero.offload_param, zero.offload_optimizer
    itemsize = config.precision.dtype.itemsize
    specs = [ParamSpec(pl.name, pl.part_numel, pl.padded_numel, persistent=pl.param.numel() <= threshold,
                       fixed_home=pl.given_home, trainable=pl.trainable, itemsize=pl.itemsize,
                       side_bytes=pl.side_bytes) for pl in planned]
    if param.auto or optimizer.auto:
        placement = plan_placement(specs, within or auto_budgets(config, layer, pg, host), itemsize=itemsize,
                                   separate_memory=layer.separate_memory,
                                   home_tier=None if param.auto else param.device,
                                   state_tier=None if optimizer.auto else optimizer.device)
    else:
        placement = uniform(specs, home_tier=param.device, state=optimizer.device, itemsize=itemsize,
                            separate_memory=layer.separate_memory)
    for pl, sp in zip(planned, placement.shards):
        pl.home, pl.state = sp.home, sp.state
    return placement


PLAN_SLACK = 16  # bytes per element of the largest partition: one more shard's state and master in flight


def replan_within(placement: Placement, need: dict[Tier, dict], config: Config, first: Budgets) -> Budgets | None:
    """Smaller auto budgets where the engine's needs under `placement` exceed a
    tier's budget (its buffers, gradients and working set came out larger than
    the room the plan left them), or None where they fit.

    The plan keeps PLAN_SLACK x the largest trainable partition's bytes of the
    host budget unclaimed: one more shard's state and master in flight than the
    reservation counts. `first`: the budgets of the first plan, the same on every rank (the
    limits: not the room a replan lowered, nor one rank's own budget)."""
    b = placement.budgets
    device_limit = None
    if config.memory.device_budget is not None:
        device_limit = int(first.device / DEVICE_SHARE)
    limits = {Tier.DEVICE: device_limit, Tier.HOST: first.host}
    held = placement.held_bytes()
    # A frozen partition has no state to hold in flight (Note [frozen parameters]).
    slack = PLAN_SLACK * max((s.part_numel for s in placement.shards if s.trainable), default=0)
    changes = {}
    for tier, field_name in ((Tier.DEVICE, "device"), (Tier.HOST, "host")):
        limit = limits[tier]
        total = sum(need.get(tier, {}).values()) + (slack if tier is Tier.HOST else 0)
        room = getattr(b, field_name)
        if limit is not None and room is not None and total > limit:
            changes[field_name] = max(0, min(room, held[tier]) - (total - limit))
    return dataclasses.replace(b, **changes) if changes else None


def grad_backlog(config: Config, planned: list, *, separate_memory: bool) -> int | None:
    """The most fp32 gradient elements held at once when every step's updates run
    during backward and gradients exist only until their update (Note [gradient
    partitions]: some optimizer state on NVMe; Note [when updates run]:
    UpdatePolicy.backlog_bound). None where all may be held (accumulation keeps them
    across micro-batches, clipping and overflow checks need them all first)."""
    policy = UpdatePolicy.of(config, separate_memory=separate_memory)
    state_tiers = {s.state for s in planned}
    if not lazy_gradients(config, state_tiers, separate_memory=separate_memory) or not policy.updates_free_gradients:
        return None
    return policy.backlog_bound(max(s.part_numel for s in planned if s.state is not None))


def lazy_gradients(config: Config, state_tiers, *, separate_memory: bool) -> bool:
    """Whether fp32 gradient partitions exist only while a gradient is pending
    (ShardContext.lazy_grads, Note [gradient partitions]): with optimizer state on
    NVMe, and beside a device with memory of its own where each update runs during
    backward and ends its gradient's life (UpdatePolicy.updates_free_gradients).
    There a host-state update reads its gradient from the pinned staging buffer
    (Note [updates from the staging buffer] in step/gradients.py), so a partition
    kept for the whole run would be 4 bytes a parameter of host memory never read:
    25.7 GiB for a 6.9B model, the difference between its state fitting the
    host and a sixth of it spilling to NVMe."""
    if Tier.NVME in state_tiers:
        return True
    return separate_memory and UpdatePolicy.of(config, separate_memory=True).updates_free_gradients
