"""A parameter frozen when the engine was built, set trainable later.

Note [unfreezing]
A parameter frozen at initialize is its home alone (Note [frozen parameters]
in offload/placement.py): no master, no moments, no gradient partition. When
its requires_grad becomes True, the next forward makes what training it
needs, as plain PyTorch would train it from that step:
  1. its optimizer state's tier: the config's offload_optimizer tier, or with
     "auto" the host while the host budget holds it, else NVMe where the
     optimizer already keeps state there (its store exists), else the device
     while the device budget holds it;
  2. every byte checked before anything changes: master and moments (12 bytes
     an element; 8 where the fp32 host home is the master), the gradient
     partition (4) where gradients are kept for the run; a shortfall raises
     MemoryError naming the parameters, the tier and the bytes, and training
     goes on as it was;
  3. its parameter group: the one that lists it (with one group, that one); a
     parameter in no group is refused, as torch's optimizer would never step it;
  4. then the master from its home's value (fp32; the fp32 host home is the
     master itself), moments zero, its step count 0, its gradients taken from
     the next backward on, the placement updated.
It happens at the start of a forward (engine(x) or model(x)), the one point
where no update of the step is still to start. A parameter unfrozen after the
forward gets no gradient in that backward (autograd recorded it frozen), as in
plain PyTorch, and is unfrozen at the next forward.
"""
from __future__ import annotations

import dataclasses
import logging

from offload.tiers import Tier, grad_tier_of

log = logging.getLogger("offload")


def state_bytes(engine, shard, tier: Tier) -> dict[Tier, int]:
    """Bytes per tier the shard's training will hold on `tier`'s side."""
    import torch

    opt = engine.optimizer
    state = 3 * shard.part_numel * 4
    if tier is Tier.HOST and shard.home is Tier.HOST and shard.dtype == torch.float32:
        state -= shard.part_numel * 4  # the fp32 host home is the master (ShardStates.aliases_home)
    if tier is Tier.NVME and opt.states.param_store is not None and shard.home is Tier.NVME and shard.dtype == torch.float32:
        state -= shard.part_numel * 4  # the parameter's file holds it (Note [shared fp32 master])
    need = {tier: state}
    if not shard.ctx.lazy_grads:
        grad = grad_tier_of(tier)
        need[grad] = need.get(grad, 0) + shard.part_numel * 4
    return need


def _choose_tier(engine, shard, held: dict[Tier, int]) -> Tier | None:
    """Note [unfreezing], 1: the tier, or None where no tier may hold it."""
    opt_cfg = engine.config.zero_optimization.offload_optimizer
    if not opt_cfg.auto:
        return opt_cfg.device
    account, opt = engine.account, engine.optimizer

    def fits(tier):
        return all(account.fits(t, held.get(t, 0) + n) for t, n in state_bytes(engine, shard, tier).items())
    if fits(Tier.HOST):
        return Tier.HOST
    if opt.states.state_store is not None:
        return Tier.NVME
    if engine.device_layer.separate_memory and fits(Tier.DEVICE):
        return Tier.DEVICE
    return None


def unfreeze(engine, shards: list) -> None:
    """Note [unfreezing]: every check first, then each shard trains."""
    opt, account = engine.optimizer, engine.account
    outside = [s.name for s in shards if opt.group_listing(s) is None]
    if outside:
        raise RuntimeError(
            f"requires_grad set to True on {_named(outside)}, frozen when the engine was built and in none of "
            "the parameter groups given to initialize: torch's optimizer would never step it either. List it "
            "in a group (model_parameters=[{'params': [...]}, ...]) when the engine is built")
    held: dict[Tier, int] = {}
    chosen = []
    for s in shards:
        tier = _choose_tier(engine, s, held)
        need = state_bytes(engine, s, tier) if tier is not None else {}
        short = [t for t, n in need.items() if not account.fits(t, held.get(t, 0) + n)]
        if tier is None or short:
            where = short[0] if short else Tier.HOST
            usage = account.usage(where)
            raise MemoryError(
                f"requires_grad set to True on {_named([x.name for x in shards])}, frozen when the engine was "
                f"built: training {s.name} needs {sum(need.values()) or 16 * s.part_numel} more bytes for its "
                f"optimizer state and gradient on the {where.value} tier, which holds {usage.now} of its budget "
                f"{usage.budget}; nothing was changed and training goes on as before. Raise "
                f"memory.{where.value}_budget, give the optimizer an nvme_path, or unfreeze fewer parameters")
        for t, n in need.items():
            held[t] = held.get(t, 0) + n
        chosen.append((s, tier))
    # Their gradients go down through the staging ring, made for the largest trainable one.
    to_host = engine.manager.to_host
    down = [s.part_numel * 4 for s, tier in chosen if grad_tier_of(tier) is not Tier.DEVICE]
    growth = to_host.ring_growth(max(down)) if to_host is not None and down else 0
    if growth and not account.fits(Tier.HOST, held.get(Tier.HOST, 0) + growth):
        usage = account.usage(Tier.HOST)
        raise MemoryError(
            f"requires_grad set to True on {_named([x.name for x in shards])}, frozen when the engine was built: "
            f"their gradients need the gradient staging ring {growth} bytes larger on the host tier, which holds "
            f"{usage.now} of its budget {usage.budget}; nothing was changed and training goes on as before. "
            "Raise memory.host_budget, or unfreeze fewer parameters")
    if growth:
        engine.step_runner.deferred.settle()  # the ring holds no gradient between steps once they ran
        to_host.grow_ring(max(down))
    for s, tier in chosen:
        init = s.home_partition().float()  # fp32 from its home (not read where the home is the master)
        s.trainable = True
        s.gradient.tier = grad_tier_of(tier)
        opt.adopt_unfrozen(s, tier, init)
        engine.step_runner.adopted(s)
        if not s.ctx.lazy_grads:
            s.gradient.allocate()
        engine.manager.watch_gradients(s)
        engine.frozen_fingerprints.pop(str(s.index), None)
    tiers = {s.name: tier for s, tier in chosen}
    plan = engine._placement
    engine._placement = dataclasses.replace(plan, shards=tuple(
        dataclasses.replace(p, state=tiers[p.name]) if p.name in tiers else p for p in plan.shards))
    log.info("unfrozen, trained from this step: %s (optimizer state: %s)", _named(list(tiers)),
             ", ".join(sorted({t.value for t in tiers.values()})))


def _named(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def unfreeze_if_asked(engine) -> None:
    """At a forward's start: a parameter frozen when the engine was built (Note [frozen
    parameters] in offload/placement.py) and set trainable since trains from this
    forward (Note [unfreezing]). One trainable when built may stop and start training
    freely: while requires_grad is False it gets no gradient, so no update, as in plain
    PyTorch."""
    # Read through ManagedParameter (1.4 ms a forward for 292 parameters on 2 loaded cores): a
    # whole model under torch.compile traces this hook, and reading the flags past it
    # (engine_access) sent that trace into a recursion (tests/engine/test_compiled_model.py).
    unfrozen = [s for s in engine.shards if s.param.requires_grad and not s.trainable]
    if unfrozen:
        unfreeze(engine, unfrozen)
