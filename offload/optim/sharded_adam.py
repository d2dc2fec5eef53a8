"""Adam/AdamW over the engine's parameter partitions, with state on any tier.

Note [optimizer state tiers]
Each shard's optimizer state is an fp32 master partition and two fp32
moments, kept on the tier `offload_optimizer.device` names:
  DEVICE  tensors on the device; updated with torch's fused Adam
  HOST    host tensors; updated with the native fused kernel (offload.ops)
  NVME    one file per shard holding [master | exp_avg | exp_avg_sq]; the step
          streams them: the reads of shards i+1 and i+2 are in flight while
          shard i is updated, and writes are asynchronous
After a shard's update its compute-dtype copy is refreshed at the parameter's
home (see Note [shard layout] in offload/partition/shard.py): the fused
kernel writes the rounded value straight into a host home; a device home
receives the new partition by all-gather; an NVMe home gets a file write.

The class is a torch.optim.Optimizer so LR schedulers drive param_groups as
usual. Its "params" are the shards' fp32 masters (DEVICE, HOST) or one empty
tensor per shard (NVME, where the masters are not in memory).
"""
from __future__ import annotations

import torch

from offload.ops import adam_step
from offload.partition.accounting import MemoryAccount, Tier
from offload.partition.shard import HomeKind, Shard


class ShardedAdam(torch.optim.Optimizer):
    def __init__(self, shards: list[Shard], initial_partition, *,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 adamw_mode: bool, tier: Tier, device: torch.device, account: MemoryAccount,
                 state_store=None, param_store=None, sub_group_size: int | None = None):
        """initial_partition(shard) -> this rank's fp32 partition of the initial weights
        (called once per shard, in order; it also moves the parameter home)."""
        self.shards = shards
        self.tier = tier
        self.state_device = device if tier is Tier.DEVICE else torch.device("cpu")
        self.account = account
        self.state_store = state_store
        self.param_store = param_store
        # zero_optimization.sub_group_size caps the optimizer-state elements read
        # ahead of the shard being updated in the streamed (NVMe) step.
        self.sub_group_size = sub_group_size
        # Per-shard step counts, as torch keeps per-parameter ones: a parameter
        # that got no gradient in a step is skipped and its count stays.
        self.shard_steps = {shard.index: 0 for shard in shards}
        params = []
        self._states: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for shard in shards:
            init = initial_partition(shard)
            nbytes = 3 * shard.part_numel * 4
            if tier is Tier.NVME:
                self.account.charge(Tier.NVME, nbytes, f"optimizer state of {shard.name}")
                packed = torch.zeros(3 * shard.part_numel, dtype=torch.float32)
                packed[:shard.part_numel].copy_(init)
                self.state_store.swap_out(self._key(shard), packed).wait()
                params.append(torch.empty(0))
                continue
            if self._aliases_home(shard):
                master = shard.host_part  # fp32 host home is the master itself
                nbytes -= shard.part_numel * 4
            else:
                master = init.to(self.state_device, torch.float32, copy=True)
            self.account.charge(tier, nbytes, f"optimizer state of {shard.name}")
            m = torch.zeros_like(master)
            v = torch.zeros_like(master)
            self._states[shard.index] = (master, m, v)
            params.append(master)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=adamw_mode)
        super().__init__(params, defaults)

    def _aliases_home(self, shard: Shard) -> bool:
        return (self.tier is Tier.HOST and shard.home is HomeKind.HOST
                and shard.dtype == torch.float32)

    @staticmethod
    def _key(shard: Shard) -> str:
        return f"optim.{shard.index}"

    # ---- the step -------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError("the engine's optimizer takes no closure; call engine.step()")
        group = self.param_groups[0]
        if self.tier is Tier.NVME:
            self._step_streamed(group)
            return
        for shard in self._stepping():
            master, m, v = self._states[shard.index]
            self._update(shard, master, m, v, group)
        if self.param_store is not None:
            self.param_store.store.wait_all()

    def _stepping(self) -> list[Shard]:
        return [s for s in self.shards if s.has_grad]

    def _step_streamed(self, group: dict) -> None:
        # Note [optimizer state tiers]: read-ahead of two shards, async writes.
        shards = self._stepping()
        buffers = {}
        pending = {}

        def start_read(i: int) -> None:
            shard = shards[i]
            buf = torch.empty(3 * shard.part_numel, dtype=torch.float32)
            buffers[i] = buf
            pending[i] = self.state_store.swap_in(self._key(shard), out=buf)

        # Up to two shards' state reads in flight beyond the one being updated,
        # fewer where that would exceed sub_group_size elements.
        cap = self.sub_group_size or float("inf")
        issued = 0  # reads started for shards[:issued]

        def top_up(current: int) -> None:
            nonlocal issued
            while issued < len(shards) and issued <= current + 2:
                if issued > current:  # a read ahead of the shard being updated
                    ahead = sum(s.part_numel for s in shards[current + 1:issued + 1])
                    if ahead > cap:
                        break
                start_read(issued)
                issued += 1

        for i, shard in enumerate(shards):
            top_up(i)
            pending.pop(i).wait()
            buf = buffers.pop(i)
            n = shard.part_numel
            master, m, v = buf[:n], buf[n:2 * n], buf[2 * n:]
            self._update(shard, master, m, v, group)
            self.state_store.swap_out(self._key(shard), buf)
        self.state_store.wait_all()
        if self.param_store is not None:
            # The next forward must read the new parameters, not a file
            # still being written.
            self.param_store.store.wait_all()

    def _update(self, shard: Shard, master, m, v, group: dict) -> None:
        beta1, beta2 = group["betas"]
        self.shard_steps[shard.index] += 1
        step = self.shard_steps[shard.index]
        grad = shard.grad_part.to(master.device, non_blocking=True)
        home_out = self._home_out(shard)
        if master.device.type == "cuda":
            _fused_torch_adam(master, grad, m, v, step, group)
            if home_out is not None:
                home_out.copy_(master)
        else:
            fused_out = home_out if home_out is not None and home_out.dtype != torch.float32 else None
            adam_step(master, grad, m, v, step=step, lr=group["lr"], beta1=beta1,
                      beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                      adamw_mode=group["adamw_mode"], out=fused_out)
            if home_out is not None and fused_out is None:
                home_out.copy_(master)
        self._publish(shard, master, home_out)

    def _home_out(self, shard: Shard) -> torch.Tensor | None:
        """Where this shard's new compute-dtype partition is written, or None if the master is it."""
        if shard.home is HomeKind.HOST:
            return None if self._aliases_home(shard) else shard.host_part
        return torch.empty(shard.part_numel, dtype=shard.dtype, device=self.state_device)

    def _publish(self, shard: Shard, master: torch.Tensor, written: torch.Tensor | None) -> None:
        if shard.home is HomeKind.DEVICE:
            shard.ctx.pg.all_gather(shard.device_full(), written.to(shard.ctx.device))
        elif shard.home is HomeKind.NVME:
            self.param_store.write(shard, written.to("cpu"))

    def master_partition(self, shard: Shard) -> torch.Tensor:
        """This rank's fp32 master partition of `shard` (a copy, on the host)."""
        if self.tier is Tier.NVME:
            buf = torch.empty(3 * shard.part_numel, dtype=torch.float32)
            self.state_store.swap_in(self._key(shard), out=buf).wait()
            return buf[:shard.part_numel].clone()
        return self._states[shard.index][0].detach().to("cpu", copy=True)

    def state_bytes(self) -> int:
        return sum(3 * s.part_numel * 4 for s in self.shards)

    # ---- checkpoints (offload/checkpoint_io) --------------------------------
    def state_tensors(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The live (master, exp_avg, exp_avg_sq) of a DEVICE/HOST-tier shard: not copies."""
        if self.tier is Tier.NVME:
            raise ValueError(f"optimizer state of {shard.name} is in a file on the NVMe tier: "
                             "use state_file()")
        return self._states[shard.index]

    def state_file(self, shard: Shard):
        """The NVMe-tier swap file holding [master | exp_avg | exp_avg_sq] of `shard`."""
        if self.tier is not Tier.NVME:
            raise ValueError(f"optimizer state of {shard.name} is on the {self.tier.value} tier, "
                             "not in a file: use state_tensors()")
        return self.state_store.path_of(self._key(shard))

    @torch.no_grad()
    def load_state_tensors(self, shard: Shard, master: torch.Tensor, exp_avg: torch.Tensor,
                           exp_avg_sq: torch.Tensor) -> None:
        """Replaces `shard`'s state with these values (part_numel fp32 elements each)."""
        for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.shape != (shard.part_numel,) or t.dtype != torch.float32:
                raise ValueError(f"{name} of {shard.name}: expected {shard.part_numel} fp32 elements, "
                                 f"got {tuple(t.shape)} {t.dtype}")
        if self.tier is Tier.NVME:
            packed = torch.cat([master.cpu(), exp_avg.cpu(), exp_avg_sq.cpu()])
            self.state_store.swap_out(self._key(shard), packed).wait()
            return
        for dst, src in zip(self._states[shard.index], (master, exp_avg, exp_avg_sq)):
            dst.copy_(src)


def _fused_torch_adam(master, grad, m, v, step: int, group: dict) -> None:
    """torch's fused kernel, for state that lives on a CUDA device."""
    beta1, beta2 = group["betas"]
    step_t = torch.tensor(float(step), device=master.device)
    fn = torch._fused_adamw_ if group["adamw_mode"] else torch._fused_adam_
    fn([master], [grad], [m], [v], [], [step_t], lr=group["lr"], beta1=beta1, beta2=beta2,
       weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)
