"""The `cuda` device layer: torch.cuda streams and events, pinned host memory.

Thin on purpose (Note [device layer] in device/layer.py): each method is the
torch.cuda call it names. Not yet run on a GPU (none has been lent).

Reuse is `record_stream`-safe: a copy on a side stream records each device
tensor it touches on that stream, so when the caller drops the tensor the
caching allocator keeps its memory until the stream's work is done, rather
than handing it to the next allocation while the copy still reads or writes
it. Pinned host memory needs nothing: torch's host allocator records an event
for every non-blocking copy out of a pinned block and defers its reuse.
"""
from __future__ import annotations

import torch

from offload.device.layer import DeviceLayer, Event, Stream


def require_cuda() -> None:
    if not torch.cuda.is_available():
        build = torch.version.cuda
        why = (f"torch {torch.__version__} is a CPU-only build" if build is None
               else f"torch {torch.__version__} (CUDA {build}) finds no usable GPU")
        raise RuntimeError(f"OFFLOAD_DEVICE=cuda: CUDA is not available here ({why}); "
                           "unset OFFLOAD_DEVICE to use the cpu layer, or OFFLOAD_DEVICE=sim "
                           "for the simulated device")


class CudaEvent(Event):
    def __init__(self) -> None:
        self.raw = torch.cuda.Event()

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, CudaStream), f"not a cuda stream: {stream!r}"
        self.raw.record(stream.raw)

    def query(self) -> bool:
        return self.raw.query()

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaStream(Stream):
    def __init__(self, name: str, raw: torch.cuda.Stream) -> None:
        self.name = name
        self.raw = raw

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, CudaEvent), f"not a cuda event: {event!r}"
        self.raw.wait_event(event.raw)

    def wait_stream(self, other: Stream) -> None:
        assert isinstance(other, CudaStream), f"not a cuda stream: {other!r}"
        self.raw.wait_stream(other.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaDevice(DeviceLayer):
    name = "cuda"
    page_locks = True

    def __init__(self, index: int | None = None) -> None:
        require_cuda()
        super().__init__()
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)

    def alloc(self, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype, device=self.device)
        self.counters.allocated(buf)
        return buf

    def free(self, buf: torch.Tensor) -> None:
        # The caching allocator frees when the last reference goes; the
        # record_stream calls in copy() keep it from reusing memory early.
        pass

    def pinned(self, numel: int, dtype: torch.dtype, name: str = "pinned") -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.counters.allocated(buf, pinned=True)
        return buf

    def stream(self, name: str) -> Stream:
        return CudaStream(name, torch.cuda.Stream(device=self.device))

    def current_stream(self) -> Stream:
        return CudaStream("default", torch.cuda.current_stream(self.device))

    def event(self) -> Event:
        return CudaEvent()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> Event:
        self._count_copy(dst, src)
        stream = stream or self.current_stream()
        assert isinstance(stream, CudaStream), f"not a cuda stream: {stream!r}"
        with torch.cuda.stream(stream.raw):
            # non_blocking is asynchronous only with pinned host memory; with
            # pageable memory CUDA stages the copy and the host waits for it.
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(stream.raw)
        done = CudaEvent()
        done.record(stream)
        return done

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def free_memory(self) -> int | None:
        return int(torch.cuda.mem_get_info(self.device)[0])
