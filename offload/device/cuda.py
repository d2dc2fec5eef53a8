"""The `cuda` device layer: torch.cuda streams and events, pinned host memory.

Thin on purpose (Note [device layer] in device/layer.py): each method is the
torch.cuda call it names.

`time_copies()` (off by default: two timing events a copy) times each copy
up or down the bus with CUDA events, for the benchmark's bus seconds per step
(`copy_seconds()`): the engine makes each way's copies on one stream
(Note [copy streams]), so their sum is the time that way of the bus was busy.

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
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] | None = None

    def time_copies(self, on: bool = True) -> None:
        """From now on, time each copy up and down the bus (read with copy_seconds())."""
        self._timed = [] if on else None

    def copy_seconds(self) -> dict[str, float]:
        """Seconds of copies "up" (host -> device) and "down" since the last call, summed
        over copies; waits for them to finish. Empty where time_copies() is off."""
        if self._timed is None:
            return {}
        timed, self._timed = self._timed, []
        seconds = {"up": 0.0, "down": 0.0}
        for way, start, end in timed:
            end.synchronize()
            seconds[way] += start.elapsed_time(end) / 1000.0
        return seconds

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
        way = None if dst.is_cuda == src.is_cuda else "up" if dst.is_cuda else "down"
        self._count_copy(dst, src, way)
        stream = stream or self.current_stream()
        assert isinstance(stream, CudaStream), f"not a cuda stream: {stream!r}"
        timed = self._timed if way is not None else None
        with torch.cuda.stream(stream.raw):
            if timed is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream.raw)
            # non_blocking is asynchronous only with pinned host memory; with
            # pageable memory CUDA stages the copy and the host waits for it.
            dst.copy_(src, non_blocking=True)
            if timed is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream.raw)
                timed.append((way, start, end))  # list.append: safe from the host worker too
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
