"""gpu-check: the GPU check in one command (`bash benchmarks/gpu/check.sh`).

Stages (benchmarks/gpu/README.md has what each runs and its time), each in a
process of its own under its own limit, all within GPU_CHECK_TOTAL_S; one
that fails or runs out of time does not stop the next:
  setup_deepspeed, setup_project + setup_ds_ops (side by side),
  cuda_tests + suite (side by side unless GPU_CHECK_SERIAL=1), bench_67m, bench_1b.
Exit status: 0 every stage passed, 1 one did not, 2 refused to start.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpucheck import budget, stages, summary
from gpucheck.budget import Budget

ROOT = Path(__file__).resolve().parents[3]
PACKAGE_DIR = Path(__file__).resolve().parent
WORDS = ("setup", "tests", "cuda_tests", "suite", "bench_67m", "bench_1b")
SETUP = ("setup_deepspeed", "setup_project", "setup_ds_ops")
# CPU test mode: a small subset of the suite (GPU_CHECK_SUITE_ARGS replaces it)
CPU_SUITE_ARGS = ('-m "not slow" tests/config/test_config.py tests/partition/test_state_machines.py '
                  'tests/sizing/test_estimate.py')


class Refused(Exception):
    """The check will not start (exit 2); nothing has run."""


def knob(env, name: str, default: str) -> str:
    """An environment knob; set but empty means its default, as ${NAME:-default} does."""
    return env.get(name) or default


def seconds(env, name: str, default: int) -> int:
    value = knob(env, name, str(default))
    if not re.fullmatch(r"[0-9]+", value):
        raise Refused(f"{name} must be a number of seconds, got '{value}'")
    return int(value)


def nproc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tmp_folder(path: str, knob_name: str) -> str:
    """A work folder that is emptied first: only under /tmp or /var/tmp, and never either one itself."""
    norm = os.path.normpath(path)
    if not re.fullmatch(r"/(var/)?tmp/.+", norm) or ".." in norm.split("/"):
        raise Refused(f"{knob_name} must be a folder under /tmp or /var/tmp (it is emptied first), got '{path}'")
    return norm


@dataclass
class Settings:
    """The knobs, read and checked before anything is written."""
    cpu: bool
    stages: set[str]  # the stage names selected (setup and tests expanded)
    total_s: int
    cap_setup: int
    cap_tests: int
    cap_67m: int
    serial: bool
    py: str
    work: str
    out: str
    suite_args: str
    cuda_args: str

    @classmethod
    def from_env(cls, env) -> Settings:
        words = knob(env, "GPU_CHECK_STAGES", "setup tests bench_67m bench_1b").split()
        for w in words:
            if w not in WORDS:
                raise Refused(f"GPU_CHECK_STAGES has '{w}': the values are setup, tests (or cuda_tests, suite "
                              f"alone), bench_67m, bench_1b")
        selected = {s for w in words for s in {"setup": SETUP, "tests": ("cuda_tests", "suite")}.get(w, (w,))}
        cpu = knob(env, "GPU_CHECK_ALLOW_CPU", "0") == "1"
        py = knob(env, "GPU_CHECK_PYTHON", sys.executable or "")
        if not py:
            raise Refused("no python3 or python on PATH")
        return cls(cpu=cpu, stages=selected, total_s=seconds(env, "GPU_CHECK_TOTAL_S", 2400 if cpu else 465),
                   # caps per stage (s); bench_1b gets what is left. The first H200 run
                   # (16 cores): setup 55, both test stages cut at 150, bench_67m 74, bench_1b 115.
                   cap_setup=900 if cpu else 150, cap_tests=seconds(env, "GPU_CHECK_TESTS_CAP", 600 if cpu else 150),
                   cap_67m=300 if cpu else 100, serial=knob(env, "GPU_CHECK_SERIAL", "0") == "1", py=py,
                   work=tmp_folder(knob(env, "GPU_CHECK_WORK", "/tmp/gpu-check"), "GPU_CHECK_WORK"),
                   out=knob(env, "OUT", str(ROOT / "gpu-check-out")),
                   suite_args=env.get("GPU_CHECK_SUITE_ARGS", CPU_SUITE_ARGS if cpu else ""),
                   cuda_args=env.get("GPU_CHECK_CUDA_ARGS", ""))


def lacking(fetched: Path) -> list[str]:
    """What .gpu-check/ (fetch.sh's folder) lacks for the setup stages."""
    wheels, debs = fetched / "wheels", fetched / "debs"
    out = []
    if not (wheels / f"deepspeed-{stages.DS_VERSION}.tar.gz").is_file():
        out.append(f"deepspeed-{stages.DS_VERSION}.tar.gz")
    if not list(wheels.glob(f"libaio-{stages.LIBAIO_VERSION}-*.whl")):
        out.append(f"py-libaio's libaio-{stages.LIBAIO_VERSION}-*.whl")
    if not list(debs.glob("libaio-dev_*.deb")):
        out.append("libaio's .debs")
    return out


def probe(py: str, what: str) -> tuple[int, str]:
    """A probes.py question to the Python under test: its exit status and last line of output."""
    try:
        r = subprocess.run([py, str(stages.PROBES), what], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, errors="replace")
    except OSError as exc:
        return 1, f"{py} does not run ({exc})"
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    return r.returncode, lines[-1] if lines else ""


def preflight(s: Settings) -> str:
    """The refusals that need the machine: no CUDA, .gpu-check/ missing. Returns the device's name."""
    if s.cpu:
        name = "none (GPU_CHECK_ALLOW_CPU=1: a test of this script, on the CPU; no GPU figures)"
        print("gpu-check: GPU_CHECK_ALLOW_CPU=1: every stage on the CPU with tiny settings, to test this script only",
              file=sys.stderr)
    else:
        rc, name = probe(s.py, "gpu")
        if rc != 0:
            raise Refused(f"{name}; this check runs on a GPU machine (GPU_CHECK_ALLOW_CPU=1 runs it on the CPU, "
                          f"to test the script only)")
    # On a GPU .gpu-check/ is always needed (the benches' NVMe contenders need its
    # libaio too); the CPU test mode asks for it only where setup is selected.
    if not s.cpu or s.stages & set(SETUP):
        missing = lacking(ROOT / ".gpu-check")
        if missing:
            raise Refused(f".gpu-check/ is missing or incomplete (it lacks {', '.join(missing)}): run "
                          f"'bash benchmarks/gpu/fetch.sh' on a machine with network and copy .gpu-check/ "
                          f"to this checkout")
    return name


def unpack_libaio(fetched: Path, dest: Path) -> Path | None:
    """libaio's headers and .so from the carried .debs, unpacked under dest (no root
    needed); returns the folder of libaio.so, or None where there is none."""
    dest.mkdir(parents=True, exist_ok=True)
    for deb in sorted((fetched / "debs").glob("*.deb")):
        if shutil.which("dpkg"):
            subprocess.run(["dpkg", "-x", str(deb), str(dest)])
        else:  # ar + tar where dpkg is absent
            names = subprocess.run(["ar", "t", str(deb)], capture_output=True, text=True).stdout.split()
            for data in [n for n in names if n.startswith("data.tar")]:
                subprocess.run(["ar", "x", str(deb), data], cwd=dest)
                subprocess.run(["tar", "-xf", data], cwd=dest)
                (dest / data).unlink(missing_ok=True)
    for folder, _, files in sorted(os.walk(dest)):
        if any(f.startswith("libaio.so") for f in files):
            return Path(folder)
    return None


def prepend(env, name: str, value: str, sep: str) -> None:
    env[name] = f"{value}{sep}{env[name]}" if env.get(name) else value


def append(env, name: str, value: str, sep: str) -> None:
    env[name] = f"{env[name]}{sep}{value}" if env.get(name) else value


def stage_env(s: Settings, work: Path, environ) -> dict:
    """The environment every stage runs in: libaio found by DeepSpeed's builds and at
    run time, the arch list its ops build for, and the GC_* settings for stages.py."""
    env = dict(environ)
    aio = work / "libaio"
    aio_lib = unpack_libaio(ROOT / ".gpu-check", aio)
    if aio_lib is not None:
        # CFLAGS/LDFLAGS for DeepSpeed's compile test, CPATH and LIBRARY_PATH for
        # torch's JIT build (which reads neither), LD_LIBRARY_PATH at run time
        append(env, "CFLAGS", f"-I{aio}/usr/include", " ")
        append(env, "LDFLAGS", f"-L{aio_lib}", " ")
        prepend(env, "CPATH", f"{aio}/usr/include", ":")
        prepend(env, "LIBRARY_PATH", str(aio_lib), ":")
        prepend(env, "LD_LIBRARY_PATH", str(aio_lib), ":")
    if s.cpu:
        # DeepSpeed's ops built against the libaio under /tmp stay out of this
        # machine's ~/.cache/torch_extensions (other users' DeepSpeed loads from there)
        env.setdefault("TORCH_EXTENSIONS_DIR", f"{work}-torch-extensions")
    else:
        env["TORCH_CUDA_ARCH_LIST"] = "9.0"  # DeepSpeed 0.19.8 cannot parse the image's '9.0a' (sm_90)
        # async_io links -lcuda: where the driver's mount has no unversioned
        # libcuda.so, the toolkit's stub serves the link (LIBRARY_PATH comes after -L).
        _, home = probe(s.py, "cuda_home")
        for d in (f"{home}/lib64/stubs", f"{home}/targets/x86_64-linux/lib/stubs"):
            if home and os.path.isfile(f"{d}/libcuda.so"):
                append(env, "LIBRARY_PATH", d, ":")
                break
    suite_workers = 2 if s.cpu else 8
    # cuda_tests with the suite's workers where it does not share the machine with it
    cuda_workers = suite_workers if s.serial or "suite" not in s.stages else (2 if s.cpu else 4)
    env.update(MAX_JOBS=str(nproc()), PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               GC_ROOT=str(ROOT), GC_PY=s.py, GC_WORK=str(work), GC_DEVICE="cpu" if s.cpu else "cuda",
               GC_WORKERS_SUITE=str(suite_workers), GC_WORKERS_CUDA=str(cuda_workers),
               GC_SUITE_ARGS=s.suite_args, GC_CUDA_ARGS=s.cuda_args,
               GC_67M_CONTENDERS=knob(env, "GPU_CHECK_67M_CONTENDERS", stages.BENCH_67M_CONTENDERS),
               GC_1B_CONTENDERS=knob(env, "GPU_CHECK_1B_CONTENDERS", stages.BENCH_1B_CONTENDERS))
    return env


@dataclass
class Stage:
    """One planned stage: its cap, the seconds it keeps for the stages after it,
    and why it cannot run (asked only when its turn comes), if it cannot."""
    name: str
    cap: int
    reserve: int
    cannot: object = None  # () -> str | None


def plan(s: Settings, have_deepspeed) -> list[list[Stage]]:
    """The selected stages in run order, grouped: a group's stages run side by side."""
    r = budget.check_reserves(s.stages)
    groups = []
    if "setup_deepspeed" in s.stages:
        groups.append([Stage("setup_deepspeed", 90, r["setup_deepspeed"])])
        # the project's build beside DeepSpeed's op builds: they share no file
        groups.append([Stage("setup_project", s.cap_setup, r["setup"]),
                       Stage("setup_ds_ops", s.cap_setup, r["setup"],
                             lambda: None if have_deepspeed() else "deepspeed does not import")])
    tests = [t for t in ("cuda_tests", "suite") if t in s.stages]
    if len(tests) == 2 and s.serial:
        groups += [[Stage("cuda_tests", s.cap_tests, r["cuda_tests_serial"])],
                   [Stage("suite", s.cap_tests, r["tests"])]]
    elif tests:  # side by side: the cuda subset is GPU-bound, the suite runs on the host
        groups.append([Stage(t, s.cap_tests, r["tests"]) for t in tests])
    if "bench_67m" in s.stages:
        groups.append([Stage("bench_67m", s.cap_67m, r["bench_67m"])])
    if "bench_1b" in s.stages:
        groups.append([Stage("bench_1b", 100000, r["bench_1b"])])
    return groups


class Runner:
    """Runs planned stages under the budget and keeps their results for the summary."""

    def __init__(self, run: summary.CheckRun, budget_: Budget, env: dict, launch=None):
        self.run, self.budget, self.env = run, budget_, env
        self.launch = launch or self._launch  # replaced in tests by a stand-in

    def _launch(self, name: str, limit: int) -> int:
        with open(self.run.log(name), "w") as log:
            return budget.run_limited([sys.executable, str(PACKAGE_DIR), "stage", name], limit, stdout=log,
                                      env={**self.env, "GC_LIMIT": str(limit)})

    def stage(self, st: Stage) -> None:
        why = st.cannot() if st.cannot else None
        if why:
            self.run.results[st.name] = summary.Result("skipped", 0, 0, why)
            return
        limit = self.budget.limit(st.cap, st.reserve)
        if limit < budget.MIN_STAGE_S:
            self.run.results[st.name] = summary.Result(
                "skipped", 0, 0, f"no time left of the {self.budget.total_s} s budget")
            print(f"gpu-check: {st.name} skipped (no time left)", file=sys.stderr)
            return
        print(f"gpu-check: {st.name} (limit {limit} s) ...", file=sys.stderr)
        start = int(self.budget.clock())
        status = budget.status_of(self.launch(st.name, limit))
        wall = int(self.budget.clock()) - start
        self.run.results[st.name] = summary.Result(status, wall, limit)
        print(f"gpu-check: {st.name}: {status} after {wall} s", file=sys.stderr)

    def group(self, group: list[Stage]) -> None:
        threads = [threading.Thread(target=self.stage, args=(st,)) for st in group]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        finally:  # stopped from outside (stop_all): the stages end with their process groups
            for t in threads:
                t.join(timeout=30)


def main(env=None) -> int:
    env = os.environ if env is None else env
    t0 = time.time()
    budget.end_all_when_stopped()
    os.chdir(ROOT)
    try:
        s = Settings.from_env(env)
        device = preflight(s)
        _, versions = probe(s.py, "env")
        work = Path(s.work)
        shutil.rmtree(work, ignore_errors=True)
        try:
            (work / "logs").mkdir(parents=True)
        except OSError as exc:
            raise Refused(f"cannot make {work} ({exc})")
        try:
            Path(s.out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Refused(f"cannot make {s.out} ({exc})")
    except Refused as exc:
        print(f"gpu-check: refused: {exc}", file=sys.stderr)
        return 2

    run = summary.CheckRun(work=work, out=s.out, total_s=s.total_s, t0=t0,
                           env_line=f"device: {device}; {nproc()} cores; {versions}")
    senv = stage_env(s, work, env)
    print(f"gpu-check: {device}; python {s.py}; out {s.out}; budget {s.total_s} s", file=sys.stderr)
    if not s.cpu:
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       stdout=sys.stderr, stderr=subprocess.DEVNULL)
    df = subprocess.run(["df", "-h", str(ROOT)], capture_output=True, text=True).stdout.splitlines()
    if df:
        print(df[-1], file=sys.stderr)

    @functools.cache
    def have_deepspeed() -> bool:  # asked once, where needed (an import of DeepSpeed takes seconds)
        return stages.importable(s.py, "deepspeed")

    groups = plan(s, have_deepspeed)
    run.order = [st.name for g in groups for st in g]
    runner = Runner(run, Budget(s.total_s, t0), senv)
    try:
        for group in groups:
            benches = [senv[f"GC_{st.name[6:].upper()}_CONTENDERS"] for st in group if st.name.startswith("bench_")]
            if any(c.startswith("deepspeed") for cs in benches for c in cs.split(",")):
                # DeepSpeed's contenders only where it imports, asked after setup
                senv["GC_HAVE_DS"] = "1" if have_deepspeed() else "0"
            runner.group(group)
            summary.publish(run)
    except SystemExit:  # stopped from outside: $OUT has what there is
        summary.publish(run)
        raise

    text = summary.summary(run)
    (Path(s.out) / "summary.txt").write_text(text)
    print(file=sys.stderr)
    sys.stderr.flush()
    print(text, end="", flush=True)
    return 0 if all(run.results.get(n, summary.Result("", 0, 0)).status == "pass" for n in run.order) else 1
