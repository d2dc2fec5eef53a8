"""What a Shard stands on: its residency states, the partition store it reads and
writes its NVMe home through, and the ShardContext every shard of one engine shares
(Note [shard layout] in partition/shard.py says what a shard is)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from offload.aio.memory import BufferCache
from offload.device import DeviceLayer
from offload.device.cpu import CpuDevice
from offload.accounting import MemoryAccount
from offload.transfers.collectives import ProcessGroupInfo
from offload.transfers.device_copies import CopyStreams
from offload.tiers import Tier

if TYPE_CHECKING:
    from offload.device import Event
    from offload.transfers.gather_ahead import PackedAllGather

class Residency(enum.Enum):
    """Where the full compute-dtype value is, and which bytes that costs.

    RELEASED  only the home partition exists (device tier: 0 bytes)
    FETCHING  an NVMe read into the device/staging buffer is in flight
              (device tier: the full parameter, already charged)
    GATHERED  the full value is on the device tier, param.data points at it
              (device tier: padded numel * itemsize)
    """

    RELEASED = "released"
    FETCHING = "fetching"
    GATHERED = "gathered"


class Transfer(Protocol):
    """An asynchronous read or write: wait() returns once it is over, or raises its error."""

    def wait(self) -> object: ...


class PendingRead(Transfer, Protocol):
    def cancel(self) -> None:
        """Waits for the bytes but skips what follows them (a prefetch nobody used)."""

    def bytes_ready(self) -> bool:
        """Whether the bytes are in: wait() would not block on the disk."""


class PendingUpdate(Protocol):
    """An optimizer update of a shard under way on the host worker (a Future, or
    overlap.TakenInAndUpdated): result() returns once it ran, or raises its error."""

    def result(self) -> object: ...


@dataclass
class InFlight:
    """What is under way for one shard, each None when nothing is (Shard.in_flight)."""

    read: "PendingRead | None" = None  # NVMe -> the gathered buffer, while FETCHING
    copy_in: "Event | None" = None  # the copy into the gathered buffer compute waits for (Note [copy streams])
    all_gather: "PackedAllGather | None" = None  # started ahead of use (Note [all-gathers ahead])
    # The update left running on the host worker: every read of the home or the gradient
    # waits for it (Note [updates under the next forward] in step/updates.py).
    update: PendingUpdate | None = None


class _FailedRead:
    """A read ahead that failed when Shard.advance finished it: its gather raises the error."""

    def __init__(self, exc: Exception):
        self._exc = exc

    def wait(self):
        raise self._exc

    def cancel(self) -> None:
        pass

    def bytes_ready(self) -> bool:
        return True


class PartitionStore(Protocol):
    """What a shard asks of the store holding NVMe homes (offload.transfers.nvme_home.ParamStore;
    tests give fakes). One thread drives it (Note [one store per thread] in engine/stores.py)."""

    def write(self, shard, part: torch.Tensor, *, borrow: bool = False) -> Transfer:
        """Starts writing this rank's partition (compute dtype, host)."""

    def read_part(self, shard, out: torch.Tensor) -> Transfer:
        """Starts reading this rank's partition into `out` (host, part_numel elements)."""

    def read_full(self, shard, full: torch.Tensor) -> PendingRead:
        """Starts filling `full` (padded flat, device tier) with the whole parameter."""

    def path_of(self, shard) -> Path:
        """The file holding this rank's partition (checkpoints copy it)."""


@dataclass(frozen=True, kw_only=True)
class ShardContext:
    """What every shard of one engine shares, complete when built (engine/build.py
    `shard_context` makes it; the engine holds it).

    param_store: NVMe homes; None when no shard is homed on NVMe.
    grad_tier: where fp32 gradient partitions live unless a shard's own plan says
    otherwise (Shard.gradient.tier), and
    lazy_grads: whether they exist only while a gradient is pending (Note [gradient partitions]).
    gathered_buffers: gathered buffers on a CPU device, reused from step to step; None: allocated each time.
    layer: the device layer every host<->device copy goes through (Note [device layer]);
    streams: its copy streams where the device has memory of its own, None on
    the cpu layer (Note [copy streams] in device_copies.py).
    """

    device: torch.device
    pg: ProcessGroupInfo
    account: MemoryAccount
    param_store: PartitionStore | None = None
    grad_tier: Tier = Tier.HOST
    lazy_grads: bool = False
    gathered_buffers: BufferCache | None = None
    layer: DeviceLayer = field(default_factory=CpuDevice)
    streams: CopyStreams | None = None


def partition_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's partition of a parameter of `numel` (Note [shard layout])."""
    return max(1, math.ceil(numel / world_size))
