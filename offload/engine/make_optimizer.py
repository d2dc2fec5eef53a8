"""The engine's optimizer, made for the plan initialize settled on: ShardedAdam over
the shards, its state on the tiers the placement gave it (Note [optimizer state
tiers] in offload/optim/sharded_adam.py)."""
from __future__ import annotations

from offload.optim.sharded_adam import ShardedAdam
from offload.simd import overlap_threads


def make_optimizer(config, shards, built, policy, *, device_layer, account, timeline, node, host_worker,
                   param_groups, driver) -> ShardedAdam:
    """param_groups: the groups by parameter name (None: one group); driver: the step that
    runs its updates (optim/driver.py; Note [the optimizer users drive])."""
    opt, zero = config.optimizer, config.zero_optimization
    groups = None
    if param_groups is not None:  # names -> the parameters build_shards settled on
        by_name = {s.name: s.param for s in shards}
        groups = [{**g, "params": [by_name[n] for n in g["params"]]} for g in param_groups]
    return ShardedAdam(
        shards, lr=opt.lr, betas=opt.betas, eps=opt.eps,
        weight_decay=opt.weight_decay, adamw_mode=opt.decoupled_weight_decay,
        tier=zero.offload_optimizer.device,
        state_tiers={s.index: p.state for s, p in zip(shards, built.placement.shards)},
        device=device_layer.device, account=account, state_store=built.state_store,
        param_store=built.param_writer, sub_group_size=zero.sub_group_size, timeline=timeline,
        param_groups=groups,
        overlap_threads=overlap_threads(zero.offload_optimizer.cpuadam_cores_perc,
                                        device_apart=device_layer.separate_memory, cores=node.threads),
        step_threads=node.threads, host_worker=host_worker, driver=driver)
