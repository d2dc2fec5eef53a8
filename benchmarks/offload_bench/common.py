"""Helpers shared by the `offload bench ...` benchmarks.

Small on purpose: timing (median of N), a description of the machine so a
figure can be traced to where it was taken, size parsing, and writing the JSON
and PNG a benchmark leaves behind. Benchmark-specific logic stays in each
benchmark's own module.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

# Re-exported: a benchmark's peak RSS is the engine's own measure (VmHWM, else ru_maxrss).
from offload.process_memory import peak_rss_bytes  # noqa: F401

# Decimal suffixes for element counts ("200M" params), binary ones for bytes ("4Mi").
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str) -> int:
    """'200M' -> 200_000_000, '4Mi' -> 4_194_304, '1000' -> 1000."""
    s = text.strip().lower().removesuffix("b")
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * _SUFFIXES[suffix])
    return int(s)


def parse_size_list(text: str) -> list[int]:
    """'1M,10M,200M' -> [1_000_000, 10_000_000, 200_000_000]; for argparse `type=`."""
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list like 1M,10M,200M, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive, got {text!r}")
    return sizes


def time_interleaved(fns: dict, repeats: int, warmup: int = 1, settle: float = 0.0) -> dict:
    """{key: fn} -> {key: (median seconds, samples)}.

    Each fn runs `warmup` times untimed (lazy state, page faults), then the fns
    are timed one call at a time in rounds, the order rotated each round, so a
    slow spell of a shared machine hits every contender alike rather than the
    one that happened to run then. The median, not the mean or the minimum:
    one sample slowed by another process must not move the figure, and the
    minimum rewards luck rather than what a training step will see.
    settle: seconds of sleep before each timed call, so that threads the previous
    contender left spinning (OpenMP's, Note [settling between contenders] in
    cpu_adam.py) have gone to sleep before the next is timed.
    """
    keys = list(fns)
    for _ in range(warmup):
        for key in keys:
            fns[key]()
    samples = {key: [] for key in keys}
    for r in range(repeats):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            if settle:
                time.sleep(settle)
            t0 = time.perf_counter()
            fns[key]()
            samples[key].append(time.perf_counter() - t0)
    return {key: (statistics.median(s), s) for key, s in samples.items()}


def time_median(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """One function: (median seconds, samples); see time_interleaved."""
    return time_interleaved({0: fn}, repeats, warmup)[0]


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict:
    """Where and when a figure was taken. The load average is recorded because
    these benchmarks are memory- and core-bound: a busy machine reads slower."""
    ram = _ram_bytes()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "ram_gib": round(ram / 2**30, 1) if ram else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


@contextlib.contextmanager
def stdout_to_stderr():
    """Send everything written to stdout, by Python or by child processes and
    native code (a JIT compiler, a library logger), to stderr while the block
    runs, so the JSON on stdout stays parseable. Works on the file descriptor,
    since loggers and subprocesses hold fd 1, not sys.stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class OtherLoad:
    """Share of the machine's CPU time taken by other processes between
    construction and `share()`: the load average lags by a minute, this says
    whether someone else was running while we measured (Linux; else None)."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / tick  # all but idle and iowait
        me = os.times()
        return time.monotonic(), busy, me.user + me.system + me.children_user + me.children_system

    def share(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None:
            return None
        wall = end[0] - self._start[0]
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 3)


def log(msg: str) -> None:
    """Progress goes to stderr so stdout stays one clean JSON document."""
    print(msg, file=sys.stderr, flush=True)


def write_json(obj: dict, out_dir: str | os.PathLike | None, name: str) -> Path | None:
    """Print obj as JSON to stdout and, if out_dir is given, save it there as `name`."""
    text = json.dumps(obj, indent=2)
    print(text)
    if out_dir is None:
        return None
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path


# What a user without matplotlib is told, once per PNG a benchmark would have written.
MATPLOTLIB_HINT = 'pip install matplotlib, or pip install -e ".[bench]" from a checkout'


def pyplot(png_name: str):
    """matplotlib.pyplot on the Agg backend (no display needed), or None if
    matplotlib is missing: a benchmark must still print its figures without it,
    but the user was promised a PNG, so one line on stderr names the PNG skipped
    and how to get it (every benchmark comes through here, so they all say it)."""
    try:
        import matplotlib
    except ImportError:
        log(f"{png_name} not written: matplotlib is not installed ({MATPLOTLIB_HINT})")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, out_dir: str | os.PathLike, name: str) -> Path:
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
