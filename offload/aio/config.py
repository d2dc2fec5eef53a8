"""Configuration of the I/O layer: frozen, keyword-only, validated once.

`AioConfig` is the one I/O config type: the JSON `aio` section is read into
it (offload/config/sections.py `AioSection`: DeepSpeed's key names, renames
and keys with no effect) and the same object reaches every `AsyncIO`, so an
accepted key cannot be dropped on the way. Its checks are the only ones; the
config layer turns their ValueError into a ConfigError.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Backend(enum.Enum):
    """Which implementation moves the bytes (see docs/AIO.md)."""

    AUTO = "auto"        # native, else libaio, else threads; threads where O_DIRECT is refused
    NATIVE = "native"    # offload._C: Linux AIO system calls from C++ threads
    LIBAIO = "libaio"    # python-libaio over the system libaio.so.1; no compiler needed
    THREADS = "threads"  # os.preadv/os.pwritev on a thread pool; works anywhere

    @classmethod
    def parse(cls, value: "Backend | str") -> "Backend":
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            accepted = ", ".join(b.value for b in cls)
            raise ValueError(f"aio.backend: {value!r} is not one of {accepted}") from None


def _integer(key: str, value, lo: int, hi: int | None = None) -> int:
    """An int in [lo, hi]; an integral float is one too (JSON configs write 1e6)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{key}: {value!r} is not an integer {bounds}")
    return value


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """The `aio` section of the offload config, as every AsyncIO receives it.

    block_size: bytes per kernel request (a multiple of 4096).
    queue_depth: requests kept in flight per worker thread.
    intra_op_parallelism: worker threads that split one large transfer.
    backend: a Backend or its name.
    verify_swap_checksums: the engine's parameter and optimizer swap files carry a
      CRC-32C of their data, checked on every read (Note [swap data checksums] in
      offload/aio/swap_store.py); false skips both, for users who accept that a
      flipped bit on disk would be trained on.
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    intra_op_parallelism: int = 1
    backend: Backend = Backend.AUTO
    verify_swap_checksums: bool = True

    def __post_init__(self):
        block_size = _integer("aio.block_size", self.block_size, lo=4096)
        if block_size % 4096:
            raise ValueError(f"aio.block_size: {block_size} is not a positive multiple of 4096")
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "queue_depth", _integer("aio.queue_depth", self.queue_depth, lo=1, hi=1024))
        object.__setattr__(self, "intra_op_parallelism",
                           _integer("aio.intra_op_parallelism", self.intra_op_parallelism, lo=1, hi=64))
        object.__setattr__(self, "backend", Backend.parse(self.backend))
        if not isinstance(self.verify_swap_checksums, bool):
            raise ValueError(f"aio.verify_swap_checksums: {self.verify_swap_checksums!r} is not true or false")

    def to_dict(self) -> dict:
        """The JSON `aio` section that gives this config."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "intra_op_parallelism": self.intra_op_parallelism, "backend": self.backend.value,
                "verify_swap_checksums": self.verify_swap_checksums}
