"""What a training step spent its time on: compute, reads, writes, optimizer, waits.

Note [timeline]
Every part of the engine that can make a step slow records spans here:
  forward, backward   the compute thread running the model (engine.__call__,
                      engine.backward)
  read, write         NVMe transfers, from submission until their completion
                      is observed (so a span can end late, never early)
  optimizer           Adam updates, on the optimizer thread when they overlap
                      backward, on the compute thread otherwise
  wait                the compute thread blocked: on a parameter read that
                      prefetch did not hide, or in step() on optimizer work
                      still running
A step is the interval from the first forward after an optimizer step to the
end of the next optimizer step; `Engine.timeline()` gives the last complete
step's spans and totals, `Engine.export_chrome_trace(path)` writes them in
the Chrome trace format (chrome://tracing, https://ui.perfetto.dev).
Recording costs two perf_counter() calls and an append per span; spans from
the optimizer thread are appended under the GIL, so no lock is needed.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass

KINDS = ("forward", "backward", "read", "write", "optimizer", "wait")


@dataclass(frozen=True)
class Span:
    kind: str
    name: str
    start: float  # seconds, time.perf_counter()
    end: float
    thread: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._current: list[Span] = []
        self._step_start: float | None = None
        self._last: list[Span] = []
        self._last_window: tuple[float, float] | None = None

    def record(self, kind: str, name: str, start: float, end: float | None = None) -> None:
        if not self.enabled:
            return
        if self._step_start is None:
            self._step_start = start
        thread = threading.current_thread().name
        self._current.append(Span(kind, name, start, time.perf_counter() if end is None else end,
                                  "compute" if thread == "MainThread" else thread))

    @contextlib.contextmanager
    def span(self, kind: str, name: str = ""):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(kind, name, start)

    def end_step(self) -> None:
        """Closes the step: its spans become the ones `last_step()` reports."""
        if not self.enabled or self._step_start is None:
            return
        self._last, self._current = self._current, []
        self._last_window = (self._step_start, time.perf_counter())
        self._step_start = None

    def last_step(self) -> dict:
        """The last complete step: wall seconds, seconds per kind, and its spans.

        Seconds per kind are summed over spans, so overlapping spans (reads in
        flight beside compute) add up to more than the wall time: that overlap
        is the point. `exposed_io_s` is the time the compute thread waited."""
        if self._last_window is None:
            return {"wall_s": 0.0, "seconds": {k: 0.0 for k in KINDS}, "exposed_io_s": 0.0, "spans": []}
        t0, t1 = self._last_window
        seconds = {k: 0.0 for k in KINDS}
        for s in self._last:
            seconds[s.kind] += s.seconds
        return {"wall_s": t1 - t0, "seconds": seconds, "exposed_io_s": seconds["wait"],
                "spans": [dict(kind=s.kind, name=s.name, start_s=s.start - t0, seconds=s.seconds,
                               thread=s.thread) for s in self._last]}

    def chrome_trace(self) -> dict:
        """The last step in the Chrome trace event format (complete events, microseconds)."""
        if self._last_window is None:
            return {"traceEvents": []}
        t0 = self._last_window[0]
        threads = sorted({s.thread for s in self._last}, key=lambda t: (t != "compute", t))
        tids = {t: i for i, t in enumerate(threads)}
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tids[t], "args": {"name": t}}
                  for t in threads]
        # Transfers overlap each other on the I/O "threads": give reads and
        # writes rows of their own so the viewer does not nest them.
        io_rows = {"read": len(tids), "write": len(tids) + 1}
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"nvme {k}s"}}
                   for k, tid in io_rows.items()]
        for s in self._last:
            tid = io_rows.get(s.kind, tids[s.thread])
            events.append({"name": s.name or s.kind, "cat": s.kind, "ph": "X", "pid": 0, "tid": tid,
                           "ts": (s.start - t0) * 1e6, "dur": max(s.seconds, 0.0) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
