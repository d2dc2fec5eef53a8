"""The deadline scheduler: one budget of seconds for a whole run, each stage's
limit cut to what that budget leaves, and a command run under such a limit.

A GPU machine is held for minutes, so both checks plan in whole seconds from
their start: a stage gets its cap, or less where the budget, after the
minimum kept back for the stages after it, leaves less. A stage offered too
little is skipped and said so, rather than started only to be killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

# check: a stage offered less than this is skipped (nothing useful starts in fewer).
MIN_STAGE_S = 15
# step: a benchmark offered less than this is skipped (a contender needs ~20 s to start).
MIN_BENCH_S = 40
# step: the least each part needs, kept back for it by the parts named before it.
STEP_LEAST_S = {"1b_fp32": 130, "1b_bf16": 110, "1b_compile": 200, "7b": 150, "67m": 100, "adam_ref": 20, "tests": 45}


class Budget:
    """Seconds left of `total_s` counted from `t0`, in whole seconds as the
    wall clock ticks (the clock is a parameter so the scheduler is tested
    without waiting)."""

    def __init__(self, total_s: int, t0: float | None = None, clock=time.time):
        self.total_s = total_s
        self.clock = clock
        self.t0 = int(clock() if t0 is None else t0)

    def elapsed(self) -> int:
        return int(self.clock()) - self.t0

    def left(self) -> int:
        return self.total_s - self.elapsed()

    def limit(self, cap: int, reserve: int) -> int:
        """A stage's limit: its cap, or what is left after `reserve` seconds kept for later stages."""
        return min(cap, self.left() - reserve)


def check_reserves(selected: set[str]) -> dict[str, int]:
    """What each of check's stages keeps back for the selected stages after it:
    60 s for bench_1b, 60 s for bench_67m, 120 s for the tests; a stage left
    out keeps nothing. Keys: the stage (or group) that keeps them."""
    b1b = 60 if "bench_1b" in selected else 0
    b67 = b1b + (60 if "bench_67m" in selected else 0)
    tests = b67 + (120 if selected & {"cuda_tests", "suite"} else 0)
    return {
        "setup_deepspeed": 60 + tests,  # and the rest of setup's minimum
        "setup": tests,
        "cuda_tests_serial": 30 + b67,  # run before suite: keeps suite's least too
        "tests": b67,
        "bench_67m": b1b,
        "bench_1b": 5,  # gets whatever is left
    }


def step_keep(parts: list[str], part: str) -> int:
    """The seconds step's `part` keeps back for the parts named after it."""
    if part not in parts:
        return 0
    return sum(STEP_LEAST_S.get(p, 0) for p in parts[parts.index(part) + 1:])


# The process groups run_limited has started and not yet reaped. Each is a
# session of its own, so a signal to the check's process group does not reach
# them: stop_all ends them where the check itself is stopped.
_running: set[int] = set()


def stop_all(signum: int, frame=None) -> None:
    """A handler for SIGTERM and SIGINT: SIGTERM to every group still running, then exit."""
    for pgid in list(_running):
        _kill_group(pgid, signal.SIGTERM)
    raise SystemExit(128 + signum)


def end_all_when_stopped() -> None:
    """Installs stop_all (from the main thread, as a check starts)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_all)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_limited(argv: list[str], limit: float | None, stdout, stderr=subprocess.STDOUT, env=None,
                kill_after: float = 10) -> int:
    """Runs argv for at most `limit` seconds, as GNU `timeout -k KILL_AFTER LIMIT`
    does: in a process group of its own, SIGTERM to the group at the limit,
    SIGKILL `kill_after` seconds later. Returns its exit status, 124 where it
    was stopped at the limit, 137 where it had to be killed. What it leaves
    running in its group when it ends goes with it: a stage's stray process
    must not outlive the stage's time. limit None: no limit (a part that keeps
    to a budget of its own)."""
    proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    _running.add(proc.pid)
    try:
        rc = proc.wait(timeout=None if limit is None else max(limit, 0))
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=kill_after)
            rc = 124
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 137
    finally:
        _running.discard(proc.pid)
    _kill_group(proc.pid, signal.SIGKILL)
    if rc < 0:  # ended by a signal nobody here sent: report it as a shell would
        rc = 128 - rc
    return rc


def status_of(rc: int) -> str:
    """check's words for an exit status."""
    if rc == 0:
        return "pass"
    if rc in (124, 137):
        return "TIMEOUT"
    return f"FAIL rc={rc}"
