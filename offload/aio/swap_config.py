"""A swap store's settings (SwapConfig) and what it counts (SwapStats)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

from offload.aio import AioConfig
from offload.aio.memory import ALIGN
from offload.aio.swap_format import file_bytes


@dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """nvme_path: directory (created if missing); files go to nvme_path/rank{rank}/.
    capacity_bytes: disk bytes the store will hold (checked against free space).
    buffer_bytes: host staging budget (pinned when CUDA exists).
    checksum: CRC-32C of each tensor, verified on swap_in (on for checkpoints).
    durable: fsync before the rename that publishes a file (for checkpoints).
    atomic: write to a temporary name and rename it over the key's file when
      complete (the default). False overwrites the key's file in place: no
      rename, no block reallocation, for scratch swap space that one process
      writes and reads back and that is deleted when it ends; a failed write
      removes the file rather than leave it half written.
    """

    nvme_path: str
    capacity_bytes: int
    buffer_bytes: int
    rank: int = 0
    checksum: bool = False
    durable: bool = False
    atomic: bool = True
    aio: AioConfig = field(default_factory=AioConfig)

    def __post_init__(self):
        object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))
        for name in ("capacity_bytes", "buffer_bytes", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"swap.{name}: must be a non-negative integer, got {value!r}")
        if self.buffer_bytes < 2 * ALIGN:
            raise ValueError(f"swap.buffer_bytes: must be at least {2 * ALIGN}, got {self.buffer_bytes}")

    @classmethod
    def for_tensors(cls, nvme_path, tensor_bytes: Iterable[int], in_flight: int = 2, **kwargs) -> "SwapConfig":
        """Sized from what the caller will hold: every tensor on disk (plus room
        to rewrite the largest when writes are atomic, since such a rewrite lands
        beside the old file), and `in_flight` of the largest in host buffers at once."""
        sizes = [file_bytes(n) for n in tensor_bytes] or [file_bytes(0)]
        rewrite = max(sizes) if kwargs.get("atomic", True) else 0
        return cls(nvme_path=nvme_path, capacity_bytes=sum(sizes) + rewrite,
                   buffer_bytes=max(in_flight, 1) * max(sizes), **kwargs)


@dataclass
class SwapStats:
    """Payload bytes moved, busy time per direction, and the time callers spent blocked."""

    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    waited_seconds: float = 0.0
    swap_outs: int = 0
    swap_ins: int = 0
    buffer_peak_bytes: int = 0

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0
