"""The `cpu` device layer: synchronous and trivial (Note [device layer] in device/layer.py).

What the engine did before the layer existed: the device is the host, a copy
is `copy_` on the calling thread, and every stream and event is already done.
"""
from __future__ import annotations

import torch

from offload.device.layer import DeviceLayer, Event, Stream


class CpuEvent(Event):
    def record(self, stream: Stream) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuStream(Stream):
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_event(self, event: Event) -> None:
        pass

    def wait_stream(self, other: Stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CpuDevice(DeviceLayer):
    name = "cpu"
    separate_memory = False

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self._default = CpuStream("default")

    def alloc(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype)
        self.counters.allocated(buf)
        return buf

    def free(self, buf: torch.Tensor) -> None:
        pass

    def pinned(self, numel: int, dtype: torch.dtype, name: str = "pinned") -> torch.Tensor:
        # Nothing to pin: host and device are the same memory. Counted all the
        # same, so the pinned-pool tests hold on every layer.
        buf = torch.empty(numel, dtype=dtype)
        self.counters.allocated(buf, pinned=True)
        return buf

    def stream(self, name: str) -> Stream:
        return CpuStream(name)

    def current_stream(self) -> Stream:
        return self._default

    def event(self) -> Event:
        return CpuEvent()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> Event:
        self._count_copy(dst, src)
        dst.copy_(src)
        return CpuEvent()

    def synchronize(self) -> None:
        pass
