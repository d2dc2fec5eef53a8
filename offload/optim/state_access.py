"""The optimizer state read and written outside the step: torch's state_dict
format (Trainer, Accelerate, Lightning), checkpoints (offload/checkpoint_io),
edits of the weights (offload.gathered), the fp32 masters, and the state of a
parameter frozen when the optimizer was made and unfrozen since.

A mixin of ShardedAdam (optim/sharded_adam.py), which owns the state's layout
(Note [optimizer state tiers]) and the step; here only moving it in and out.
"""
from __future__ import annotations

import psutil
import torch

from offload.partition.shard import Shard
from offload.tiers import Tier


class StateAccess:
    # torch's format, for Trainer's and Accelerate's checkpoints (they torch.save it),
    # with each shard's fp32 master beside its moments so a resume is exact in bf16
    # too. Indices follow self.shards. Before the first step it is empty, as torch's.
    def state_dict(self) -> dict:
        self.settle("optimizer.state_dict()")
        stepped = [(i, s) for i, s in self._indexed() if self.shard_steps[s.index]]
        need = sum(3 * s.part_numel * 4 for _, s in stepped)
        if need > 0.5 * psutil.virtual_memory().available:
            raise MemoryError(
                f"optimizer.state_dict(): the optimizer state takes {need / 2**30:.1f} GiB as tensors, more "
                "than half the memory available; save and resume it with engine.save_checkpoint(dir) / "
                "engine.load_checkpoint(dir), which stream it")
        state = {}
        for i, shard in stepped:
            master, m, v = self._host_state(shard)
            state[i] = {"step": torch.tensor(float(self.shard_steps[shard.index])), "exp_avg": m,
                        "exp_avg_sq": v, "offload_fp32_master": master}
        groups, first = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(first, first + n))})
            first += n
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self.settle()
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("optimizer.load_state_dict: the saved parameter groups "
                             f"{None if groups is None else [len(g['params']) for g in groups]} do not match "
                             f"this optimizer's {[len(g['params']) for g in self.param_groups]}")
        saved = {int(k): v for k, v in state_dict.get("state", {}).items()}
        for i, shard in self._indexed():
            entry = saved.get(i)
            n = shard.part_numel
            if entry is None:
                if self.shard_steps[shard.index] == 0:
                    continue  # fresh already (Accelerate's prepare round trip reads nothing)
                zeros = torch.zeros(n, dtype=torch.float32)
                self.load_state_tensors(shard, self.master_partition(shard), zeros, zeros.clone())
                self.shard_steps[shard.index] = 0
                continue
            master = entry.get("offload_fp32_master")
            master = self.master_partition(shard) if master is None else master
            self.load_state_tensors(shard, *(_partition(t, shard) for t in (master, entry["exp_avg"],
                                                                              entry["exp_avg_sq"])))
            self.shard_steps[shard.index] = int(float(entry["step"]))
        for group, saved_group in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})

    def _host_state(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host copies of (master, exp_avg, exp_avg_sq), this rank's partition."""
        n = shard.part_numel
        if self.state_tier(shard) is Tier.NVME:
            shared = self.shares_master(shard)
            packed = torch.empty((2 if shared else 3) * n, dtype=torch.float32)
            self.state_store.swap_in(self._key(shard), out=packed).wait()
            if shared:
                return shard.home_partition().float(), packed[:n], packed[n:]
            return packed[:n], packed[n:2 * n], packed[2 * n:]
        return tuple(t.detach().to("cpu", copy=True) for t in self._states[shard.index])


    def master_partition(self, shard: Shard) -> torch.Tensor:
        """This rank's fp32 master partition of `shard` (a copy, on the host); a frozen
        shard's home value in fp32 (it has no master: Note [frozen parameters])."""
        self.settle()
        if not shard.trainable:
            return shard.home_partition().to(torch.float32)
        if self.shares_master(shard):
            return shard.home_partition()
        if self.state_tier(shard) is Tier.NVME:
            buf = torch.empty(3 * shard.part_numel, dtype=torch.float32)
            self.state_store.swap_in(self._key(shard), out=buf).wait()
            return buf[:shard.part_numel].clone()
        return self._states[shard.index][0].detach().to("cpu", copy=True)

    def state_bytes(self) -> int:
        return sum((2 if self.shares_master(s) else 3) * s.part_numel * 4 for s in self.shards)

    # ---- checkpoints (offload/checkpoint_io) --------------------------------
    def state_tensors(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The live (master, exp_avg, exp_avg_sq) of a DEVICE/HOST-tier shard: not copies."""
        self.settle()
        if self.state_tier(shard) is Tier.NVME:
            raise ValueError(f"optimizer state of {shard.name} is in a file on the NVMe tier: "
                             "use state_file()")
        return self._states[shard.index]

    def state_file(self, shard: Shard):
        """The NVMe-tier swap file holding [master | exp_avg | exp_avg_sq] of `shard`, or
        [exp_avg | exp_avg_sq] where shares_master(shard) (the master is the parameter's file)."""
        if self.state_tier(shard) is not Tier.NVME:
            raise ValueError(f"optimizer state of {shard.name} is on the {self.state_tier(shard).value} tier, "
                             "not in a file: use state_tensors()")
        return self.state_store.path_of(self._key(shard))

    @torch.no_grad()
    def set_master(self, shard: Shard, master: torch.Tensor) -> None:
        """Replaces `shard`'s fp32 master (part_numel elements): the weights were edited
        outside training (offload.gathered); the moments stay. A frozen shard has no
        master: its edited home is all there is."""
        if not shard.trainable:
            return
        self.settle()
        if self.shares_master(shard):
            shard.ctx.param_store.write(shard, master.cpu().contiguous()).wait()
        elif self.state_tier(shard) is Tier.NVME:
            packed = torch.empty(3 * shard.part_numel, dtype=torch.float32)
            self.state_store.swap_in(self._key(shard), out=packed).wait()
            packed[:shard.part_numel].copy_(master)
            self.state_store.swap_out(self._key(shard), packed).wait()
        else:
            self._states[shard.index][0].copy_(master)

    @torch.no_grad()
    def load_state_tensors(self, shard: Shard, master: torch.Tensor, exp_avg: torch.Tensor,
                           exp_avg_sq: torch.Tensor) -> None:
        """Replaces `shard`'s state with these values (part_numel fp32 elements each)."""
        for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.shape != (shard.part_numel,) or t.dtype != torch.float32:
                raise ValueError(f"{name} of {shard.name}: expected {shard.part_numel} fp32 elements, "
                                 f"got {tuple(t.shape)} {t.dtype}")
        if self.shares_master(shard):
            shard.ctx.param_store.write(shard, master.cpu().contiguous()).wait()
            packed = torch.cat([exp_avg.cpu(), exp_avg_sq.cpu()])
            self.state_store.swap_out(self._key(shard), packed).wait()
            return
        if self.state_tier(shard) is Tier.NVME:
            packed = torch.cat([master.cpu(), exp_avg.cpu(), exp_avg_sq.cpu()])
            self.state_store.swap_out(self._key(shard), packed).wait()
            return
        for dst, src in zip(self._states[shard.index], (master, exp_avg, exp_avg_sq)):
            dst.copy_(src)

    def group_listing(self, shard: Shard) -> int | None:
        """The index of the parameter group a frozen shard's parameter is listed in (None:
        in none). With one group (none given) every parameter joins it: 0."""
        if self._one_group:
            return 0
        return next((gi for gi, g in enumerate(self.param_groups) if any(p is shard.param for p in g["params"])),
                    None)

    def adopt_unfrozen(self, shard: Shard, tier: Tier, init: torch.Tensor) -> None:
        """A parameter frozen when the optimizer was made, trainable now (Note [unfreezing]
        in engine/unfreeze.py): its state is made on `tier` (master `init`, this rank's
        fp32 partition; moments zero, step count 0), in the group that lists it. The
        caller checked the group and the budget; the shard is trainable already."""
        gi = self.group_listing(shard)
        if gi is None:
            raise RuntimeError(f"parameter {shard.name} is in no parameter group")
        self._frozen.pop(id(shard.param), None)
        self._state_tiers[shard.index] = tier
        self.shard_steps[shard.index] = 0
        if not self._one_group:
            self._group_of[shard.index] = gi
        self.shards = sorted([*self.shards, shard], key=lambda s: s.index)
        self.init_state(shard, init)


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
