"""`offload bench soak`: what it judges flat, and a short run end to end."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_bench import soak

ROOT = Path(__file__).resolve().parents[2]


def _args(**overrides):
    p = argparse.ArgumentParser()
    soak.add_arguments(p)
    args = p.parse_args(["--steps", "40", "--checkpoint-every", "10", "--keep", "1"])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def _samples(last=None, **grow):
    """Samples every 10 steps to 40, flat but for the series in `grow` (name -> added per sample)
    and in `last` (name -> added to the last sample only)."""
    flat = {"rss": 300 * 2**20, "fds": 6, "threads_python": 2, "threads_os": 6, "swap_bytes": 5 * 2**20,
            "swap_files": 31, "checkpoint_bytes": 7 * 2**20, "checkpoint_files": 34, "gc_objects": 10**5}
    samples = [{"step": step, **{k: v + grow.get(k, 0) * i for k, v in flat.items()}}
               for i, step in enumerate(range(0, 41, 10))]
    for k, v in (last or {}).items():
        samples[-1][k] += v
    return samples


def _failed(samples, args):
    return soak._checks(samples, soak._summary(samples, 10, 10), args, 10, [10, 20, 30, 40])


def test_flat_series_pass_and_each_growing_one_is_named():
    args = _args()
    assert _failed(_samples(), args) == []
    for name in soak.NO_GROWTH:  # one more at the last checkpoint is growth
        failed = _failed(_samples(last={name: 1}), args)
        assert failed == [f"{name} grew across checkpoint cycles: {_samples()[1][name]} after the checkpoint "
                          f"at step 10, then {_samples()[1][name] + 1} at step 40"], failed
    # RSS: 5% of the ~305 MiB at step 10 (~15.3 MiB) is under 20 MiB, so it is the limit.
    assert _failed(_samples(rss=5 * 2**20), args) == []  # 15.0 MiB from step 10 to 40
    failed = _failed(_samples(rss=6 * 2**20), args)  # 18.0 MiB
    assert failed == ["rss grew 18.0 MiB from step 10 to the end (allowed 15.3 MiB: 20 MiB and 5%)"], failed


def test_summary_reports_the_slope_per_100_steps_after_the_warmup_and_the_checkpoints_kept():
    summary = soak._summary(_samples(fds=1, checkpoint_files=1), 10, 20)  # one more every 10 steps
    assert summary["fds"] == {"start": 7, "end": 10, "min": 7, "max": 10, "range": 3, "slope_per_100_steps": 10.0}
    # The checkpoint directory's from the first step with --keep checkpoints on disk (20 here).
    assert summary["checkpoint_files"] == {"start": 36, "end": 38, "min": 36, "max": 38, "range": 2,
                                           "slope_per_100_steps": 10.0}


@pytest.mark.slow  # a fresh interpreter and 20 NVMe steps: 6.5 s on 2 quiet cores, 24 s on busy ones
def test_a_short_soak_is_flat_and_leaves_only_its_report(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "offload", "bench", "soak", "--steps", "20", "--checkpoint-every",
                           "10", "--keep", "1", "--batch", "1", "--seq", "8"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["flat"] and report["failed"] == []
    assert [s["step"] for s in report["samples"]] == [0, 10, 20]
    assert report["load_at"] == 10
    assert report["after_close"]["swap_files"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_out"]  # the swap and checkpoint directory went
    # The PNG needs matplotlib, which the [test] extra does not install (common.pyplot says so on stderr).
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert sorted(p.name for p in (tmp_path / "bench_out").iterdir()) == ["soak.json"] + ["soak.png"] * has_matplotlib
    if not has_matplotlib:
        assert "soak.png not written: matplotlib is not installed" in proc.stderr
