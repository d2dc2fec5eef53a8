"""Every shard's optimizer state: the one owner of where it lives and of its bytes
(Note [optimizer state tiers] in optim/sharded_adam.py). ShardedAdam holds one and
runs the update over it; the state's tensors, files and masters are read and
written here, the way the tier each lives on needs.

Reads and writes of values here do not wait for updates in flight: ShardedAdam's
own methods of the same names wait first (ShardedAdam.settle), and are what code
outside the optimizer calls; where it lives (state_tier, shares_master,
state_file) is read here directly.
"""
from __future__ import annotations

import torch

from offload.accounting import MemoryAccount
from offload.aio.memory import aligned_tensor
from offload.optim.state_stream import StateLayout
from offload.partition.shard import Shard
from offload.tiers import Tier


class ShardStates:
    """(master, exp_avg, exp_avg_sq) of each trainable shard, on the tier its plan gave it."""

    def __init__(self, shards: list[Shard], *, tier: Tier, state_tiers: dict[int, Tier] | None,
                 device: torch.device, account: MemoryAccount, state_store, param_store):
        """tier: every shard's, but for those `state_tiers` (shard.index -> Tier) puts elsewhere."""
        self._tiers = {s.index: (state_tiers or {}).get(s.index, tier) for s in shards}
        self.device, self.account = device, account
        self.state_store, self.param_store = state_store, param_store
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # ---- where it lives --------------------------------------------------------
    def state_tier(self, shard: Shard) -> Tier | None:
        """Where `shard`'s optimizer state lives; None: it is frozen and has none."""
        return self._tiers.get(shard.index)

    @property
    def state_tiers(self) -> frozenset:
        """Every tier some shard's state lives on."""
        return frozenset(self._tiers.values())

    def aliases_home(self, shard: Shard) -> bool:
        """Whether the fp32 host home is the master itself (no copy of it kept)."""
        return (self.state_tier(shard) is Tier.HOST and shard.home is Tier.HOST
                and shard.dtype == torch.float32)

    # Note [shared fp32 master]
    # With state on NVMe and an fp32 parameter homed on NVMe, the parameter's
    # file holds exactly the master's bits (it is written from the master
    # after each update). So the master is kept once, there: the state file
    # holds only the two moments. That saves a write of 4 bytes/element per
    # step, and usually a read too: when the gradient arrives during an
    # overlapped backward, the parameter is gathered (its backward read it),
    # and the update takes the master from that copy instead of the disk.
    # The stream learns which shards arrive so (as it learns their order),
    # and reads the master of any that does not.
    def shares_master(self, shard: Shard) -> bool:
        return (self.state_tier(shard) is Tier.NVME and shard.home is Tier.NVME
                and shard.dtype == torch.float32 and self.param_store is not None)

    def layout(self, shard: Shard) -> StateLayout:
        return StateLayout(shard.part_numel, self.shares_master(shard))

    def read_master(self, shard: Shard, out: torch.Tensor):
        return self.param_store.read_part(shard, out)

    @staticmethod
    def key(shard: Shard) -> str:
        return f"optim.{shard.index}"

    def state_file(self, shard: Shard):
        """The NVMe-tier swap file holding [master | exp_avg | exp_avg_sq] of `shard`, or
        [exp_avg | exp_avg_sq] where shares_master(shard) (the master is the parameter's file)."""
        if self.state_tier(shard) is not Tier.NVME:
            raise ValueError(f"optimizer state of {shard.name} is on the {self.state_tier(shard).value} tier, "
                             "not in a file: use state_tensors()")
        return self.state_store.path_of(self.key(shard))

    def state_bytes(self, shards: list[Shard]) -> int:
        return sum((2 if self.shares_master(s) else 3) * s.part_numel * 4 for s in shards)

    # ---- made, read, written --------------------------------------------------
    def init_state(self, shard: Shard, init: torch.Tensor) -> None:
        """Takes `init`, this rank's fp32 partition of the shard's initial weights,
        as its master (moments zero). The shard is already home."""
        nbytes = 3 * shard.part_numel * 4
        tier = self.state_tier(shard)
        if tier is Tier.NVME:
            shared = self.shares_master(shard)  # then the parameter's file holds `init`
            nbytes = (2 if shared else 3) * shard.part_numel * 4
            self.account.charge(Tier.NVME, nbytes, f"optimizer state of {shard.name}")
            packed = torch.zeros(nbytes // 4, dtype=torch.float32)
            if not shared:
                packed[:shard.part_numel].copy_(init)
            self.state_store.swap_out(self.key(shard), packed).wait()
            return
        if self.aliases_home(shard):
            master = shard.host_part  # fp32 host home is the master itself
            nbytes -= shard.part_numel * 4
        elif tier is Tier.DEVICE:
            master = init.to(self.device, torch.float32, copy=True)
        else:
            # Aligned: a new value homed on NVMe is written from it straight
            # to disk, with no staging copy (Note [direct transfers]).
            master = aligned_tensor(shard.part_numel, torch.float32).copy_(init.reshape(-1))
        self.account.charge(tier, nbytes, f"optimizer state of {shard.name}")
        self._tensors[shard.index] = (master, torch.zeros_like(master), torch.zeros_like(master))

    def adopt(self, shard: Shard, tier: Tier, init: torch.Tensor) -> None:
        """A shard frozen when the optimizer was made, trainable now: its state made on `tier`."""
        self._tiers[shard.index] = tier
        self.init_state(shard, init)

    def live(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The live (master, exp_avg, exp_avg_sq) of a DEVICE/HOST-tier shard: not copies."""
        if self.state_tier(shard) is Tier.NVME:
            raise ValueError(f"optimizer state of {shard.name} is in a file on the NVMe tier: "
                             "use state_file()")
        return self._tensors[shard.index]

    def host_copies(self, shard: Shard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host copies of (master, exp_avg, exp_avg_sq), this rank's partition."""
        n = shard.part_numel
        if self.state_tier(shard) is Tier.NVME:
            shared = self.shares_master(shard)
            packed = torch.empty((2 if shared else 3) * n, dtype=torch.float32)
            self.state_store.swap_in(self.key(shard), out=packed).wait()
            if shared:
                return shard.home_partition().float(), packed[:n], packed[n:]
            return packed[:n], packed[n:2 * n], packed[2 * n:]
        return tuple(t.detach().to("cpu", copy=True) for t in self._tensors[shard.index])

    def master_partition(self, shard: Shard) -> torch.Tensor:
        """This rank's fp32 master partition of `shard` (a copy, on the host); a frozen
        shard's home value in fp32 (it has no master: Note [frozen parameters])."""
        if not shard.trainable:
            return shard.home_partition().to(torch.float32)
        if self.shares_master(shard):
            return shard.home_partition()
        if self.state_tier(shard) is Tier.NVME:
            buf = torch.empty(3 * shard.part_numel, dtype=torch.float32)
            self.state_store.swap_in(self.key(shard), out=buf).wait()
            return buf[:shard.part_numel].clone()
        return self._tensors[shard.index][0].detach().to("cpu", copy=True)

    @torch.no_grad()
    def set_master(self, shard: Shard, master: torch.Tensor) -> None:
        """Replaces `shard`'s fp32 master (part_numel elements); the moments stay."""
        if self.shares_master(shard):
            shard.ctx.param_store.write(shard, master.cpu().contiguous()).wait()
        elif self.state_tier(shard) is Tier.NVME:
            packed = torch.empty(3 * shard.part_numel, dtype=torch.float32)
            self.state_store.swap_in(self.key(shard), out=packed).wait()
            packed[:shard.part_numel].copy_(master)
            self.state_store.swap_out(self.key(shard), packed).wait()
        else:
            self._tensors[shard.index][0].copy_(master)

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
            self.state_store.swap_out(self.key(shard), packed).wait()
            return
        if self.state_tier(shard) is Tier.NVME:
            packed = torch.cat([master.cpu(), exp_avg.cpu(), exp_avg_sq.cpu()])
            self.state_store.swap_out(self.key(shard), packed).wait()
            return
        for dst, src in zip(self._tensors[shard.index], (master, exp_avg, exp_avg_sq)):
            dst.copy_(src)

    def clear(self) -> None:
        """Host or device memory held until the engine's last reference went: freed at close."""
        self._tensors.clear()
