"""Configuration of the I/O layer: frozen, keyword-only, validated once."""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields


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
            raise ValueError(f"aio.backend: unknown backend {value!r} (accepted: {accepted})") from None


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """`aio` section of the offload config.

    block_size: bytes per kernel request (a multiple of 4096).
    queue_depth: requests kept in flight per worker thread.
    intra_op_parallelism: worker threads that split one large transfer.
    backend: a Backend or its name.
    """

    block_size: int = 1 << 20
    queue_depth: int = 32
    intra_op_parallelism: int = 1
    backend: Backend = Backend.AUTO

    def __post_init__(self):
        object.__setattr__(self, "backend", Backend.parse(self.backend))
        if not isinstance(self.block_size, int) or self.block_size < 4096 or self.block_size % 4096:
            raise ValueError(f"aio.block_size: must be a positive multiple of 4096, got {self.block_size!r}")
        if not isinstance(self.queue_depth, int) or not 1 <= self.queue_depth <= 1024:
            raise ValueError(f"aio.queue_depth: must be an integer in [1, 1024], got {self.queue_depth!r}")
        if not isinstance(self.intra_op_parallelism, int) or not 1 <= self.intra_op_parallelism <= 64:
            raise ValueError(
                f"aio.intra_op_parallelism: must be an integer in [1, 64], got {self.intra_op_parallelism!r}"
            )

    @classmethod
    def from_dict(cls, section: dict) -> "AioConfig":
        """Builds from a config dict; an unknown key is an error naming it."""
        accepted = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - accepted)
        if unknown:
            raise ValueError(f"aio: unknown key(s) {unknown} (accepted: {sorted(accepted)})")
        return cls(**section)
