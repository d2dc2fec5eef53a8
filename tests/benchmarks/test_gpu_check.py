"""benchmarks/gpu/gpucheck, what check.sh and step_check.sh run on a GPU machine:
the deadline scheduler and the summary functions directly (a fake clock, hand-made
logs and records), the record plugin through a tiny pytest run (whole and cut),
and both entry points as a CPU dry run in their test mode (GPU_CHECK_ALLOW_CPU=1,
STEP_CHECK_ALLOW_CPU=1): the refusals (exit 2, nothing run), the files left in
$OUT and their shape, exit statuses, a stage cut by the budget with the next
still reporting, a stage skipped for lack of time, step's parts in the order
named. No setup stage runs: nothing is installed."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"


def _gpucheck():
    """The package by its file (it is no installed module), sys.path left as it is."""
    spec = importlib.util.spec_from_file_location("gpucheck", GPU / "gpucheck" / "__init__.py",
                                                  submodule_search_locations=[str(GPU / "gpucheck")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["gpucheck"] = package
    spec.loader.exec_module(package)


_gpucheck()
from gpucheck import budget, check, step, summary  # noqa: E402
from gpucheck.summary import CheckRun, Result  # noqa: E402

PLUGIN_DIR = GPU / "gpucheck" / "pytest_plugin"


class Clock:
    """A wall clock the test moves."""

    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def clean_env(**knobs) -> dict:
    """This process's environment without any GPU_CHECK_*, STEP_CHECK_* or OUT of the caller's, plus knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "STEP_CHECK_")) and k != "OUT"}
    return {**env, **knobs}


def entry(what, timeout=150, **knobs):
    """The entry point the wrappers exec, run as they run it."""
    return subprocess.run([sys.executable, str(GPU / "gpucheck"), what], env=clean_env(**knobs), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------ the scheduler
def test_a_limit_is_the_cap_or_what_the_budget_leaves_after_the_reserve():
    clock = Clock()
    b = budget.Budget(100, clock=clock)
    assert b.limit(cap=150, reserve=30) == 70
    assert b.limit(cap=50, reserve=30) == 50
    clock.t += 60.7  # whole seconds, as the wall clock ticks
    assert (b.elapsed(), b.left(), b.limit(cap=150, reserve=30)) == (60, 40, 10)


def test_each_check_stage_keeps_the_least_of_the_selected_stages_after_it():
    every = {"setup_deepspeed", "setup_project", "setup_ds_ops", "cuda_tests", "suite", "bench_67m", "bench_1b"}
    assert budget.check_reserves(every) == {"setup_deepspeed": 300, "setup": 240, "cuda_tests_serial": 150,
                                            "tests": 120, "bench_67m": 60, "bench_1b": 5}
    # a stage left out keeps nothing
    assert budget.check_reserves({"setup_project", "suite"})["setup"] == 120
    assert budget.check_reserves({"cuda_tests", "bench_1b"})["tests"] == 60
    assert budget.check_reserves({"bench_67m"})["bench_67m"] == 0


def test_each_step_part_keeps_the_least_of_the_parts_named_after_it():
    parts = ["setup", "67m", "1b_bf16", "tests"]
    assert [budget.step_keep(parts, p) for p in parts] == [100 + 110 + 45, 110 + 45, 45, 0]
    assert budget.step_keep(["project", "1b_compile", "tests"], "project") == 200 + 45
    assert budget.step_keep(["tests", "1b_fp32"], "tests") == 130


def settings(**knobs) -> check.Settings:
    return check.Settings.from_env({"GPU_CHECK_ALLOW_CPU": "1", "GPU_CHECK_WORK": "/tmp/gpu-check-unit", **knobs})


def runner(tmp_path, s, clock, took, rcs=None):
    """check's Runner with a stand-in for the stage process: each stage takes
    `took[name]` seconds of the fake clock (its whole limit where it is None) and
    exits with rcs[name]; returns the runner and the launches (name, limit) in order."""
    run = CheckRun(work=tmp_path, out=str(tmp_path), total_s=s.total_s, t0=clock.t, env_line="")
    launched = []

    def launch(name, limit):
        launched.append((name, limit))
        clock.t += limit if took.get(name) is None else took[name]
        return (rcs or {}).get(name, 0)

    return check.Runner(run, budget.Budget(s.total_s, clock.t, clock), {}, launch), launched


def test_a_stage_cut_by_the_budget_does_not_stop_the_next_and_one_offered_too_little_is_skipped(tmp_path):
    s = settings(GPU_CHECK_STAGES="tests bench_67m bench_1b", GPU_CHECK_TOTAL_S="400", GPU_CHECK_SERIAL="1")
    groups = check.plan(s, have_deepspeed=lambda: True)
    assert [[st.name for st in g] for g in groups] == [["cuda_tests"], ["suite"], ["bench_67m"], ["bench_1b"]]
    clock = Clock()
    r, launched = runner(tmp_path, s, clock, {"cuda_tests": None, "suite": 10, "bench_67m": 80, "bench_1b": 1},
                         rcs={"cuda_tests": 124, "bench_67m": 1})
    for g in groups:
        r.group(g)
    # cuda_tests keeps 30 s for suite and 120 s for the benches; it runs to its limit
    assert launched == [("cuda_tests", 250), ("suite", 30), ("bench_67m", 80), ("bench_1b", 55)]
    assert {n: x.status for n, x in r.run.results.items()} == {
        "cuda_tests": "TIMEOUT", "suite": "pass", "bench_67m": "FAIL rc=1", "bench_1b": "pass"}
    assert (r.run.results["suite"].wall, r.run.results["suite"].limit) == (10, 30)

    # the same plan where suite eats bench_67m's time: bench_67m is skipped, bench_1b still runs
    clock = Clock()
    r, launched = runner(tmp_path, s, clock, {"cuda_tests": 200, "suite": 140})
    for g in groups:
        r.group(g)
    assert [name for name, _ in launched] == ["cuda_tests", "suite", "bench_1b"]
    assert r.run.results["bench_67m"] == Result("skipped", 0, 0, "no time left of the 400 s budget")
    assert launched[-1] == ("bench_1b", 400 - 340 - 5)


def test_side_by_side_stages_share_the_reserve_and_a_stage_that_cannot_run_says_why(tmp_path):
    s = settings(GPU_CHECK_STAGES="setup tests", GPU_CHECK_TOTAL_S="1000")
    groups = check.plan(s, have_deepspeed=lambda: False)
    assert [[st.name for st in g] for g in groups] == [["setup_deepspeed"], ["setup_project", "setup_ds_ops"],
                                                       ["cuda_tests", "suite"]]
    clock = Clock()
    r, launched = runner(tmp_path, s, clock, {"setup_deepspeed": 20, "setup_project": 30, "cuda_tests": 5,
                                              "suite": 5})
    for g in groups:
        r.group(g)
    # setup_project: its cap (900 s in CPU mode) cut to what is left after the tests' 120 s
    assert launched[:2] == [("setup_deepspeed", 90), ("setup_project", 1000 - 20 - 120)]
    assert r.run.results["setup_ds_ops"] == Result("skipped", 0, 0, "deepspeed does not import")
    # side by side: both test stages offered the same limit (cap 600 in CPU mode)
    assert sorted(launched[2:]) == [("cuda_tests", 600), ("suite", 600)]


def test_bad_knobs_are_refused_before_anything_is_written():
    for knobs, said in [({"GPU_CHECK_STAGES": "setup bogus"}, "GPU_CHECK_STAGES has 'bogus'"),
                        ({"GPU_CHECK_TESTS_CAP": "2m"}, "GPU_CHECK_TESTS_CAP must be a number of seconds"),
                        ({"GPU_CHECK_TOTAL_S": "-5"}, "GPU_CHECK_TOTAL_S must be a number of seconds"),
                        ({"GPU_CHECK_WORK": "/home/x"}, "GPU_CHECK_WORK must be a folder under /tmp"),
                        ({"GPU_CHECK_WORK": "/tmp/.."}, "GPU_CHECK_WORK must be a folder under /tmp")]:
        with pytest.raises(check.Refused, match=re.escape(said)):
            settings(**knobs)
    s = settings(GPU_CHECK_STAGES="cuda_tests", GPU_CHECK_SUITE_ARGS="")
    assert (s.stages, s.suite_args, s.total_s, s.cap_tests) == ({"cuda_tests"}, "", 2400, 600)


def test_step_refuses_an_unknown_part_and_reads_its_defaults():
    with pytest.raises(check.Refused, match="STEP_CHECK_PARTS has '70b'"):
        step.Step({"STEP_CHECK_PARTS": "67m 70b"}, 0)
    with pytest.raises(check.Refused, match="STEP_CHECK_TOTAL_S must be a number of seconds"):
        step.Step({"STEP_CHECK_TOTAL_S": "10m"}, 0)
    with pytest.raises(check.Refused, match="STEP_CHECK_WORK must be a folder under /tmp"):
        step.Step({"STEP_CHECK_WORK": "/"}, 0)
    s = step.Step({}, 0)
    assert (s.parts, s.budget.total_s, s.dev) == (["setup", "1b_fp32", "1b_bf16", "67m", "adam_ref", "tests"], 575,
                                                  ["--device", "cuda"])
    s = step.Step({"STEP_CHECK_ALLOW_CPU": "1", "STEP_CHECK_PARTS": "tests 67m"}, 0)
    assert (s.parts, s.budget.total_s, s.dev, s.env["GPU_CHECK_ALLOW_CPU"]) == (["tests", "67m"], 1500,
                                                                                ["--device", "cpu"], "1")


def test_what_a_gpu_check_folder_lacks_is_named(tmp_path):
    assert check.lacking(tmp_path) == ["deepspeed-0.19.8.tar.gz", "py-libaio's libaio-0.9.5-*.whl", "libaio's .debs"]
    for name in ("wheels/deepspeed-0.19.8.tar.gz", "wheels/libaio-0.9.5-py3-none-any.whl",
                 "debs/libaio-dev_0.3.113-4_amd64.deb"):
        write(tmp_path / name, "")
    assert check.lacking(tmp_path) == []


# ------------------------------------------------------------------ the summary
def record(path: Path, lines: list[str]) -> Path:
    return write(path, "".join(f"{line}\n" for line in lines))


def test_finished_counts_and_failures_come_from_the_record_each_test_once(tmp_path):
    rec = record(tmp_path / "suite.record", [
        "collected\t5\t", "passed\tt.py::a\tcall", "failed\tt.py::b\tcall", "error\tt.py::b\tteardown",
        "error\tt.py::c\tsetup", "error\tt.py::c\tsetup", "skipped\tt.py::d\tsetup", "collected\t5\t"])
    assert summary.finished_counts(rec, tmp_path / "none.log") == \
        "4 of 5 tests finished: 1 passed, 1 failed, 2 errors, 1 skipped"
    assert summary.failed_ids(rec) == ["FAILED t.py::b", "ERROR  t.py::c (at setup)"]
    assert summary.failed_lines(rec, 1) == ["    FAILED t.py::b", "    ... and 1 more: tests.log names them all"]
    # no record (the plugin did not load): pytest -q's progress letters
    log = write(tmp_path / "x.log", "..F.s  [ 50%]\nxX.E\nnot a progress line.\n")
    assert summary.finished_counts(tmp_path / "empty.record", log) == \
        "9 tests finished (counted from pytest's progress letters)"


def check_run(tmp_path, results, order=None) -> CheckRun:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return CheckRun(work=tmp_path, out=str(out), total_s=465, t0=time.time() - 100, env_line="device: X",
                    order=order or list(results), results=results)


def train_json(path: Path, results: dict) -> Path:
    return write(path, json.dumps({"params": 940_000_000, "settings": {"batch": 8, "seq": 1024}, "results": results}))


def test_the_summary_names_each_stage_its_status_and_what_it_counted(tmp_path):
    run = check_run(tmp_path, {
        "setup_deepspeed": Result("pass", 21, 90), "cuda_tests": Result("TIMEOUT", 150, 150),
        "suite": Result("FAIL rc=1", 80, 150), "bench_1b": Result("FAIL rc=1", 115, 300),
        "bench_67m": Result("skipped", 0, 0, "no time left of the 465 s budget")},
        order=["setup_deepspeed", "setup_project", "cuda_tests", "suite", "bench_67m", "bench_1b"])
    write(run.log("setup_deepspeed"), "Processing ...\ndeepspeed 0.19.8 at /x/deepspeed/__init__.py\n")
    record(run.record("cuda_tests"), ["collected\t412\t", "passed\ta\tcall", "failed\tb\tcall"])
    write(run.log("cuda_tests"), ".F")
    write(run.log("suite"), ".F\nFAILED t.py::x - boom\n=== 1 failed, 1 passed in 2.0s ===\n")
    write(run.log("bench_1b"), "== torch\n")
    train_json(tmp_path / "bench_1b" / "train.json", {
        "torch": {"median_s": 0.1, "step_times_s": [0.1] * 3, "tokens_per_s": 81920, "tflops": 500.0,
                  "peak_rss_bytes": 2**31, "peak_gpu_bytes": 3 * 2**30},
        "deepspeed-nvme": {"skipped": True, "error": "no time left"}})
    text = summary.summary(run)
    lines = text.splitlines()
    assert lines[0].startswith("== gpu-check summary (") and lines[1] == "device: X"
    assert lines[2].split() == ["stage", "status", "wall_s", "limit_s", "counts", "/", "medians"]
    rows = {line.split()[0]: line for line in lines[3:] if not line.startswith(" ")}
    assert rows["setup_deepspeed"].split() == ["setup_deepspeed", "pass", "21", "90", "deepspeed", "0.19.8"]
    assert "setup_project" not in rows  # planned, not reached: no row
    assert rows["cuda_tests"].endswith("stopped at its 150 s limit; 2 of 412 tests finished: 1 passed, 1 failed")
    assert rows["suite"].endswith("FAIL rc=1         80     150  1 failed, 1 passed in 2.0s")
    assert rows["bench_67m"].endswith("skipped            0       0  no time left of the 465 s budget")
    # a bench whose only misses are contenders skipped for time is partial
    assert rows["bench_1b"].startswith("bench_1b         partial") and \
        rows["bench_1b"].endswith("940.0M params, batch 8 x seq 1024: 1 ok, 0 failed, 1 skipped")
    assert "    torch            ok    0.100 s/step (median of 3), 81920 tok/s, 500 TFLOPS, RSS 2.0 GiB, GPU 3.0 GiB" \
        in lines
    assert "    deepspeed-nvme   skip  no time left" in lines
    assert lines.index("    FAILED b") == lines.index(rows["cuda_tests"]) + 1
    assert lines[-1] == f"total: 100 s of the 465 s budget; files in {run.out}: summary.txt"


def test_publish_leaves_at_most_eight_files_and_the_test_logs_say_what_happened(tmp_path):
    run = check_run(tmp_path, {"cuda_tests": Result("TIMEOUT", 20, 20), "bench_67m": Result("pass", 30, 100)})
    record(run.record("cuda_tests"), ["collected\t3\t", "passed\ta\tcall", "failed\tb\tcall"])
    write(Path(f"{run.record('cuda_tests')}.reports"), "----- FAILED b (at call)\nE   assert 1 == 2\n")
    write(run.log("cuda_tests"), ".F")  # killed mid-line
    write(run.log("bench_67m"), "".join(f"line {i}\n" for i in range(300)))
    train_json(tmp_path / "bench_67m" / "train.json", {})
    write(tmp_path / "bench_67m" / "train.png", "png")
    summary.publish(run)
    out = Path(run.out)
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "setup.log", "summary.txt", "tests.log",
                                                     "train_67m.json", "train_67m.png"]
    assert (out / "setup.log").read_text() == ""
    assert (out / "tests.log").read_text() == (
        "===== cuda_tests: TIMEOUT; 2 of 3 tests finished: 1 passed, 1 failed =====\n"
        "--- failed or erroring, in the order they happened (1) ---\nFAILED b\n"
        "--- the first 15 of their reports, as they happened ---\n----- FAILED b (at call)\nE   assert 1 == 2\n"
        "--- the log's last 200 lines (of 0) ---\n.F\n")
    bench = (out / "bench.log").read_text().splitlines()
    assert bench[0] == "===== bench_67m (last 250 lines of 300) =====" and bench[1] == "line 50"
    assert "files in" in (out / "summary.txt").read_text().splitlines()[-1]


# ------------------------------------------------------------------ step's pieces
def test_the_24gb_knob_and_the_24gb_run_joining_the_first_json(tmp_path):
    assert step.with_24gb("fp32", "fp32 bf16") and step.with_24gb("bf16", "1")
    assert not step.with_24gb("fp32", "bf16") and not step.with_24gb("bf16", "0")
    first = train_json(tmp_path / "a.json", {"torch": {"median_s": 1.0}})
    second = train_json(tmp_path / "b.json", {"offload-auto": {"median_s": 2.0}})
    step.merge_24gb(first, second)
    assert json.loads(first.read_text())["results"] == {"torch": {"median_s": 1.0},
                                                        "offload-auto-24GB": {"median_s": 2.0}}


def test_step_reports_each_contender_and_our_critical_path(tmp_path):
    steps = [{"optimizer_gparams_per_s": 2.0, "bus": {"up_bytes": 2e9, "up_s": 0.1, "down_bytes": 1e9,
                                                      "down_s": 0.05}}] * 3
    train_json(tmp_path / "train_1b_bf16.json", {
        "offload-cpu": {"median_s": 0.414, "peak_gpu_bytes": 2**30, "peak_rss_bytes": 2**34, "losses": [6.1, 6.0],
                        "timeline_per_step": steps, "bus_rate_gbps": {"up": 50},
                        "critical_path_median": {"compute_s": 0.1, "wait_s": 0.2, "optimizer_s": 0.3}},
        "deepspeed-cpu": {"error": "exit status 1"}})
    lines = step.report(tmp_path)
    assert lines == [
        "== train_1b_bf16.json: 0.940B params",
        "  offload-cpu        0.414 s  GPU 1.0 GiB  RSS 16.0 GiB  compute 0.100 wait 0.200 opt 0.300 adam 2.00 G/s"
        "  up 2.00 GB 0.100 s down 1.00 GB 0.050 s  rate {'up': 50}  losses [6.1, 6.0]",
        "  deepspeed-cpu      FAILED: exit status 1"]


# ------------------------------------------------------------------ the record plugin
PLUGGED_TESTS = """
    import time
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("fixture")

    def test_pass(): pass
    def test_fail(): assert 1 == 2
    def test_error(broken): pass
    @pytest.mark.skip
    def test_skip(): pass
    @pytest.mark.xfail
    def test_xfail(): assert False
    def test_sleep(): time.sleep({sleep})
"""


def plugged(tmp_path, sleep):
    tests = write(tmp_path / "test_plugged.py", PLUGGED_TESTS.replace("{sleep}", str(sleep)))
    rec = tmp_path / "plugged.record"
    env = clean_env(GC_RECORD=str(rec), PYTHONPATH=str(PLUGIN_DIR))
    argv = [sys.executable, "-m", "pytest", "-p", "gc_record", "-p", "no:cacheprovider", "-q", str(tests)]
    return argv, env, rec


@pytest.mark.slow  # a pytest process
def test_the_record_plugin_writes_each_outcome_and_each_failures_report(tmp_path):
    argv, env, rec = plugged(tmp_path, 0)
    assert subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, timeout=60).returncode == 1
    assert [line.split("\t") for line in rec.read_text().splitlines()] == [
        ["collected", "6", ""], ["passed", "test_plugged.py::test_pass", "call"],
        ["failed", "test_plugged.py::test_fail", "call"], ["error", "test_plugged.py::test_error", "setup"],
        ["skipped", "test_plugged.py::test_skip", "setup"], ["xfailed", "test_plugged.py::test_xfail", "call"],
        ["passed", "test_plugged.py::test_sleep", "call"]]
    reports = Path(f"{rec}.reports").read_text()
    assert reports.startswith("----- FAILED test_plugged.py::test_fail (at call)\n")
    assert "----- ERROR test_plugged.py::test_error (at setup)\n" in reports and "RuntimeError: fixture" in reports


@pytest.mark.slow  # a pytest process, killed mid-run
def test_a_run_cut_short_still_counts_what_finished(tmp_path):
    argv, env, rec = plugged(tmp_path, 120)
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (rec.exists() and "test_xfail" in rec.read_text()):
            time.sleep(0.1)
        time.sleep(0.3)  # inside test_sleep now
    finally:
        proc.kill()
        proc.wait()
    assert summary.finished_counts(rec, tmp_path / "none.log") == \
        "5 of 6 tests finished: 1 passed, 1 failed, 1 error, 1 skipped, 1 xfailed"
    assert summary.failed_ids(rec) == ["FAILED test_plugged.py::test_fail",
                                       "ERROR  test_plugged.py::test_error (at setup)"]


# ------------------------------------------------------------------ the entry points, CPU dry runs
@pytest.mark.slow  # three short processes
def test_an_unknown_stage_or_part_is_refused_through_the_wrappers_and_nothing_runs(tmp_path):
    for script, knobs, said in [
            ("check.sh", {"GPU_CHECK_STAGES": "setup bench_2b"}, "gpu-check: refused: GPU_CHECK_STAGES has 'bench_2b'"),
            ("step_check.sh", {"STEP_CHECK_PARTS": "67m 70b"}, "step-check: refused: STEP_CHECK_PARTS has '70b'")]:
        knobs.update(OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"),
                     STEP_CHECK_WORK=str(tmp_path / "work"), GPU_CHECK_ALLOW_CPU="1", STEP_CHECK_ALLOW_CPU="1")
        r = subprocess.run(["bash", str(GPU / script)], env=clean_env(**knobs), capture_output=True, text=True,
                           timeout=60)
        assert (r.returncode, r.stdout) == (2, ""), r.stderr
        assert r.stderr.startswith(said)
        assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@pytest.mark.slow  # two short processes
def test_no_cuda_and_no_gpu_check_folder_are_refused(tmp_path):
    # torch without CUDA (a stand-in torch: the answer is the same on a GPU machine)
    write(tmp_path / "fake" / "torch.py", """
        import types
        __version__ = "0.0+cpu"
        version = types.SimpleNamespace(cuda=None)
        cuda = types.SimpleNamespace(is_available=lambda: False)
    """)
    r = entry("check", OUT=str(tmp_path / "out"), PYTHONPATH=str(tmp_path / "fake"))
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert r.stderr.startswith("gpu-check: refused: CUDA is not available: torch 0.0+cpu (a CPU-only build)")
    assert "GPU_CHECK_ALLOW_CPU=1 runs it on the CPU" in r.stderr
    # a checkout without .gpu-check/: setup refused, even in the CPU test mode
    shutil.copytree(GPU / "gpucheck", tmp_path / "repo" / "benchmarks" / "gpu" / "gpucheck",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, str(tmp_path / "repo" / "benchmarks" / "gpu" / "gpucheck"), "check"],
                       env=clean_env(GPU_CHECK_ALLOW_CPU="1", GPU_CHECK_STAGES="setup", OUT=str(tmp_path / "out")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and not (tmp_path / "out").exists()
    assert ".gpu-check/ is missing or incomplete (it lacks deepspeed-0.19.8.tar.gz, py-libaio's " \
           "libaio-0.9.5-*.whl, libaio's .debs): run 'bash benchmarks/gpu/fetch.sh'" in r.stderr


CUDA_LIKE = """
    import time
    import pytest
    pytestmark = pytest.mark.any_device
    def test_a(): pass
    def test_b(): assert 1 == 2
    def test_c(): time.sleep(300)
"""
SUITE_LIKE = """
    import pytest
    def test_ok(): pass
    def test_bad(): raise ValueError("boom")
    @pytest.mark.skip
    def test_skipped(): pass
"""


def rows(text: str) -> dict:
    return {line.split()[0]: line for line in text.splitlines() if re.match(r"(cuda_tests|suite|bench_\w+) ", line)}


@pytest.mark.slow  # ~22 s: a test stage cut at its limit by the budget
def test_check_cuts_a_stage_at_the_budget_and_the_next_still_runs_and_reports(tmp_path):
    cuda = write(tmp_path / "t" / "test_cuda_like.py", CUDA_LIKE)
    suite = write(tmp_path / "t" / "test_suite_like.py", SUITE_LIKE)
    out = tmp_path / "out"
    # serial: cuda_tests keeps 30 s for suite, so of a 55 s budget it gets ~20 s and is cut
    r = entry("check", OUT=str(out), GPU_CHECK_WORK=str(tmp_path / "work"), GPU_CHECK_ALLOW_CPU="1",
              GPU_CHECK_STAGES="cuda_tests suite", GPU_CHECK_SERIAL="1", GPU_CHECK_TOTAL_S="55",
              GPU_CHECK_CUDA_ARGS=str(cuda), GPU_CHECK_SUITE_ARGS=str(suite))
    assert r.returncode == 1, r.stderr
    text = (out / "summary.txt").read_text()
    assert r.stdout == text  # the summary printed last
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "setup.log", "summary.txt", "tests.log"]
    assert text.splitlines()[1].startswith("device: none (GPU_CHECK_ALLOW_CPU=1")
    found = rows(text)
    m = re.fullmatch(r"cuda_tests +TIMEOUT +(\d+) +(\d+)  stopped at its (\d+) s limit; "
                     r"2 of 3 tests finished: 1 passed, 1 failed", found["cuda_tests"])
    assert m and budget.MIN_STAGE_S <= int(m[2]) == int(m[3]) <= 55 - 30, found["cuda_tests"]
    # node ids are relative to pytest's rootdir, which is /tmp where the checkout is under /tmp too
    assert re.search(r"^    FAILED \S*test_cuda_like\.py::test_b$", text, re.M), text
    assert re.fullmatch(r"suite +FAIL rc=1 +\d+ +\d+  1 failed, 1 passed, 1 skipped in [0-9.]+s", found["suite"])
    assert re.search(r"^    FAILED \S*test_suite_like\.py::test_bad$", text, re.M), text
    tests_log = (out / "tests.log").read_text()
    assert "===== cuda_tests: TIMEOUT; 2 of 3 tests finished: 1 passed, 1 failed =====" in tests_log
    assert "E   assert 1 == 2" in tests_log and "E   ValueError: boom" in tests_log
    assert re.search(r"gpu-check: cuda_tests \(limit \d+ s\) \.\.\.\n", r.stderr)


@pytest.mark.slow  # a torch import for the summary's first line
def test_check_skips_a_stage_offered_less_than_its_minimum_and_says_so(tmp_path):
    out = tmp_path / "out"
    r = entry("check", OUT=str(out), GPU_CHECK_WORK=str(tmp_path / "work"), GPU_CHECK_ALLOW_CPU="1",
              GPU_CHECK_STAGES="bench_1b", GPU_CHECK_TOTAL_S="10")
    assert r.returncode == 1
    assert "gpu-check: bench_1b skipped (no time left)" in r.stderr
    assert rows(r.stdout)["bench_1b"] == \
        "bench_1b         skipped            0       0  no time left of the 10 s budget"


@pytest.mark.slow  # ~20 s: two quick benches and a test stage
def test_step_runs_its_parts_in_the_order_named(tmp_path):
    tests = write(tmp_path / "t" / "test_quick.py", "import pytest\n@pytest.mark.any_device\ndef test_a(): pass\n")
    out = tmp_path / "out"
    r = entry("step", OUT=str(out), STEP_CHECK_WORK=str(tmp_path / "work"), STEP_CHECK_ALLOW_CPU="1",
              STEP_CHECK_PARTS="67m 1b_bf16 tests", STEP_CHECK_TOTAL_S="600", STEP_CHECK_67M="torch",
              STEP_CHECK_1B_BF16="torch", STEP_CHECK_24GB="0", GPU_CHECK_CUDA_ARGS=str(tests))
    text = (out / "summary.txt").read_text()
    assert r.stdout == text
    assert sorted(p.name for p in out.iterdir()) == ["bench.log", "summary.txt", "tests.log", "train_1b_bf16.json",
                                                     "train_67m.json"]
    notes = [line for line in text.splitlines() if line.startswith("step-check: ")]
    assert [n.split()[1] for n in notes] == ["67m", "1b_bf16", "tests"], notes
    exits = [int(re.search(r" exit (\d+) ", n)[1]) for n in notes]
    assert exits[2] == 0  # the test stage's one test passed
    assert r.returncode == (0 if exits == [0, 0, 0] else 1), (notes, r.stderr)  # a bench may fail, said so
    assert text.index("== train_1b_bf16.json") < text.index("== train_67m.json")  # the report's fixed order
    assert re.search(r"^  torch +[0-9.]+ s  GPU 0\.0 GiB  RSS", text, re.M)
    assert json.loads((out / "train_1b_bf16.json").read_text())["settings"]["precision"] == "bf16"
    bench = (out / "bench.log").read_text()
    assert bench.index("===== 67m (last 80 lines)") < bench.index("===== 1b_bf16 (last 80 lines)")
    tests_log = (out / "tests.log").read_text()
    assert re.search(r"^cuda_tests +pass .* 1 passed", tests_log, re.M)


SLEEPER = """
    import os, time
    import pytest

    @pytest.mark.any_device
    def test_sleep():
        with open(os.environ["SLEEPER_PID"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(300)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow  # a check stopped while its test stage runs
def test_a_check_stopped_from_outside_ends_its_stages(tmp_path):
    tests, pid_file = write(tmp_path / "t" / "test_sleeper.py", SLEEPER), tmp_path / "pid"
    env = clean_env(OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"), GPU_CHECK_ALLOW_CPU="1",
                    GPU_CHECK_STAGES="cuda_tests", GPU_CHECK_CUDA_ARGS=str(tests), SLEEPER_PID=str(pid_file))
    proc = subprocess.Popen([sys.executable, str(GPU / "gpucheck"), "check"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (pid_file.exists() and pid_file.read_text()):
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        assert alive(pid)
        proc.terminate()
        assert proc.wait(timeout=30) == 128 + 15
    finally:
        proc.kill()
    deadline = time.time() + 10
    while time.time() < deadline and alive(pid):
        time.sleep(0.1)
    assert not alive(pid)  # the stage's pytest went with the check (its own session: no signal reached it)


def test_step_summarises_the_adam_reference_per_form(tmp_path):
    (tmp_path / "adam_reference.json").write_text(json.dumps({
        "size": 1000, "steps": 2, "host_sqrt": "ieee", "device": "cuda:0",
        "worst_step": {"fused": {"param": {"share": 0.25, "max_ulps": 3},
                                 "exp_avg": {"share": 1.0, "max_ulps": 1674226721, "rel_error": 3.2e-7}}}}))
    lines = step.adam_reference_lines(tmp_path)
    assert lines[0] == "== adam_reference.json: 1,000 elements, 2 steps, host sqrt ieee"
    assert lines[1] == ("  torch fused    on cuda:0: param 25.000% differ (max 3 ulps), "
                        "exp_avg 100.000% differ (max 1674226721 ulps, rel 3.2e-07)")
    (tmp_path / "adam_reference.json").write_text("{")
    assert "unreadable" in step.adam_reference_lines(tmp_path)[0]
    assert step.adam_reference_lines(tmp_path / "absent") == []
    assert "adam_ref" in step.PARTS and budget.step_keep(["adam_ref", "tests"], "adam_ref") == 45
