"""The tiers a state can live on: one type for the config, the accounting and
the shards (FSDP2 keeps one `offload_policy` from its API down to each
parameter; three enums here once named the same places, with tables between them)."""
from __future__ import annotations

import enum


class Tier(enum.Enum):
    """Where bytes live. The value is offload's name (memory reports, errors,
    `memory.<value>_budget`); `offload_device` is DeepSpeed's spelling in
    `zero_optimization.offload_*.device`, the config's JSON.

    DEVICE  the GPU; on a CPU-only host, plain memory under memory.device_budget
    HOST    host memory (pinned when CUDA exists)
    NVME    files under nvme_path/offload-<host>-<pid>-<random>/rank{r}/
    """

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    @property
    def offload_device(self) -> str:
        """"none", "cpu" or "nvme": the `device` of an offload section that puts a state here."""
        return _OFFLOAD_DEVICE[self]

    @classmethod
    def from_offload_device(cls, name: str) -> "Tier":
        """The tier an offload section's `device` ("none", "cpu", "nvme") names; KeyError otherwise."""
        return _BY_OFFLOAD_DEVICE[name]


def grad_tier_of(state: Tier) -> Tier:
    """Where a parameter's fp32 gradient partition waits for its update: beside its
    optimizer state on the device, else on the host (NVMe state is read into host
    buffers to be updated)."""
    return Tier.DEVICE if state is Tier.DEVICE else Tier.HOST


_OFFLOAD_DEVICE = {Tier.DEVICE: "none", Tier.HOST: "cpu", Tier.NVME: "nvme"}
_BY_OFFLOAD_DEVICE = {name: tier for tier, name in _OFFLOAD_DEVICE.items()}
