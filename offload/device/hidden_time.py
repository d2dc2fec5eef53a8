"""How much transfer time was hidden behind compute: pure functions over intervals.

Note [hidden transfer time]
A transfer is hidden when compute did not wait for it. Over a window (one
training step):
  busy     the union of the transfers' spans (copies on any stream, or NVMe
           reads), clipped to the window: time during which at least one
           transfer was in flight; two copies at once count once
  exposed  the part of `busy` during which the compute thread was blocked
           (intersection of the two unions)
  hidden   busy - exposed; the hidden fraction is hidden / busy, None when
           nothing was transferred (not 1: there was nothing to hide)
Where the blocked intervals come from:
- host<->device copies on the sim (device/sim.py): `SimDevice.blocked` holds
  (start, end, thread) of each wait that blocked a host thread: the default
  stream's `wait_event`, `Event.synchronize` and what goes through it
  (`Stream.synchronize`, the layer's `synchronize`, a copy from pageable
  memory). Only the compute thread's count: the optimizer thread waiting a
  gradient's D2H copy does not stall compute. A copy on the default stream
  runs on the compute thread itself, so it is exposed whole.
- NVMe reads (offload/timeline.py, Note [timeline]): "read" spans, and the
  compute thread's "wait" spans. A wait on the optimizer while a read is in
  flight counts as exposed too, so the figure never overstates the hiding.
The figure is wall-clock overlap, not causation: compute blocked on one
thing while a transfer it did not need was in flight counts that transfer
as exposed. It errs towards exposed, never towards hidden.
"""
from __future__ import annotations

from typing import Iterable, Sequence

Interval = tuple[float, float]


def union(intervals: Iterable[Sequence[float]]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time; empty ones dropped.

    Only the first two fields of each item are read, so (start, end, thread)
    records pass as they are."""
    spans = []
    for item in intervals:
        start, end = item[0], item[1]
        if end < start:
            raise ValueError(f"interval ({start!r}, {end!r}) ends before it starts")
        if end > start:
            spans.append((start, end))
    spans.sort()
    merged: list[Interval] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Sequence[float]]) -> float:
    """Seconds covered by at least one interval."""
    return sum(end - start for start, end in union(intervals))


def intersect(a: Iterable[Sequence[float]], b: Iterable[Sequence[float]]) -> list[Interval]:
    """The time covered by both a and b, as disjoint sorted intervals."""
    left, right = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start, end = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        if end > start:
            out.append((start, end))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


def hidden(transfers: Iterable[Sequence[float]], blocked: Iterable[Sequence[float]],
           window: Interval | None = None) -> dict:
    """busy, exposed and hidden seconds, and the hidden fraction (Note [hidden transfer time])."""
    transfers, blocked = list(transfers), list(blocked)
    if window is not None:
        transfers = intersect(transfers, [window])
    busy = union(transfers)
    busy_s = length(busy)
    exposed_s = length(intersect(busy, blocked))
    return {"busy_s": busy_s, "exposed_s": exposed_s, "hidden_s": busy_s - exposed_s,
            "hidden_fraction": (1.0 - exposed_s / busy_s) if busy_s > 0 else None}


def copy_overlap(schedule, blocked, window: Interval, thread: str) -> dict:
    """The sim's copies (`SimDevice.schedule`, CopySpans) in `window`: their hidden
    fraction against `thread`'s blocked intervals (`SimDevice.blocked`), and each
    copy that touched the window (stream, bytes, start and end relative to the
    window's start; end None while still in flight at the window's end; the
    modeled seconds, bytes / bandwidth + jitter: a sim copy also spends the real
    memcpy and poison fill, so its span is longer)."""
    t0, t1 = window
    spans, timeline = [], []
    for copy in list(schedule):
        started, finished = copy.started, copy.finished
        if started is None or started >= t1 or (finished is not None and finished <= t0):
            continue
        end = t1 if finished is None else finished
        spans.append((copy.stream, started, end))
        timeline.append({"stream": copy.stream, "bytes": copy.nbytes, "src": copy.src, "dst": copy.dst,
                         "start_s": started - t0, "end_s": None if finished is None else finished - t0,
                         "modeled_s": copy.modeled_s})
    waits = [(start, end) for start, end, who in list(blocked) if who == thread]
    # A copy on the default stream runs on the compute thread: exposed whole.
    waits += [(start, end) for stream, start, end in spans if stream == "default"]
    figures = hidden([(start, end) for _, start, end in spans], waits, window)
    figures["step_s"] = t1 - t0
    figures["copies"] = len(timeline)
    figures["bytes"] = sum(c["bytes"] for c in timeline)
    figures["modeled_s"] = sum(c["modeled_s"] for c in timeline)  # summed, not a union
    blocked_in_step = intersect(waits, [window])
    figures["compute_blocked_s"] = length(blocked_in_step)  # on copies in flight or not
    figures["compute_blocked"] = [(start - t0, end - t0) for start, end in blocked_in_step]
    return {**figures, "timeline": timeline}


def read_overlap(step: dict) -> dict:
    """The NVMe reads of one step, `Timeline.last_step()` (wall_s; spans with start_s,
    seconds, kind, thread): their hidden fraction against the compute thread's waits,
    within the step (a read issued by the step before counts from the step's start)."""
    spans = step["spans"]
    reads = [(s["start_s"], s["start_s"] + s["seconds"]) for s in spans if s["kind"] == "read"]
    waits = [(s["start_s"], s["start_s"] + s["seconds"]) for s in spans
             if s["kind"] == "wait" and s["thread"] == "compute"]
    return {**hidden(reads, waits, (0.0, step["wall_s"])), "reads": len(reads)}
