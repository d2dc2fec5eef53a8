"""Optimizer state in torch's state_dict format, for Trainer, Accelerate and
Lightning (they torch.save it): functions of a ShardedAdam (optim/sharded_adam.py),
whose state_dict() and load_state_dict() wait for updates in flight and call them.
Each shard's fp32 master goes beside its moments, so a resume is exact in bf16 too.
Indices follow the parameter groups' params, as torch's do; before the first step
it is empty, as torch's.
"""
from __future__ import annotations

import psutil
import torch

from offload.partition.shard import Shard


def state_dict_of(opt) -> dict:
    stepped = [(i, s) for i, s in opt.indexed() if opt.shard_steps[s.index]]
    need = sum(3 * s.part_numel * 4 for _, s in stepped)
    if need > 0.5 * psutil.virtual_memory().available:
        raise MemoryError(
            f"optimizer.state_dict(): the optimizer state takes {need / 2**30:.1f} GiB as tensors, more "
            "than half the memory available; save and resume it with engine.save_checkpoint(dir) / "
            "engine.load_checkpoint(dir), which stream it")
    state = {}
    for i, shard in stepped:
        master, m, v = opt.states.host_copies(shard)
        state[i] = {"step": torch.tensor(float(opt.shard_steps[shard.index])), "exp_avg": m,
                    "exp_avg_sq": v, "offload_fp32_master": master}
    groups, first = [], 0
    for group in opt.param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(first, first + n))})
        first += n
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_torch_state_dict(opt, state_dict: dict) -> None:
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if groups is None or [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError("optimizer.load_state_dict: the saved parameter groups "
                         f"{None if groups is None else [len(g['params']) for g in groups]} do not match "
                         f"this optimizer's {[len(g['params']) for g in opt.param_groups]}")
    saved = {int(k): v for k, v in state_dict.get("state", {}).items()}
    states = opt.states
    for i, shard in opt.indexed():
        entry = saved.get(i)
        n = shard.part_numel
        if entry is None:
            if opt.shard_steps[shard.index] == 0:
                continue  # fresh already (Accelerate's prepare round trip reads nothing)
            zeros = torch.zeros(n, dtype=torch.float32)
            states.load_state_tensors(shard, states.master_partition(shard), zeros, zeros.clone())
            opt.shard_steps[shard.index] = 0
            continue
        master = entry.get("offload_fp32_master")
        master = states.master_partition(shard) if master is None else master
        states.load_state_tensors(shard, *(_partition(t, shard) for t in (master, entry["exp_avg"],
                                                                            entry["exp_avg_sq"])))
        opt.shard_steps[shard.index] = int(float(entry["step"]))
    for group, saved_group in zip(opt.param_groups, groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _partition(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A saved state tensor as this rank's fp32 partition: ours already is; torch's
    (the parameter's shape, one process) is flattened and padded."""
    flat = t.detach().reshape(-1).to("cpu", torch.float32)
    if flat.numel() == shard.part_numel:
        return flat
    if flat.numel() == shard.numel and shard.ctx.pg.world_size == 1:
        return torch.cat([flat, flat.new_zeros(shard.part_numel - flat.numel())])
    raise ValueError(f"optimizer state of {shard.name}: {flat.numel()} elements, expected "
                     f"{shard.part_numel} (this rank's partition) or {shard.numel} (the parameter)")
