"""check's stages, each run in a child process of its own
(`python benchmarks/gpu/gpucheck stage NAME`) under the stage's limit, so that
when its time is up the whole process group goes: pip, the compilers, the
pytest workers, the benchmark and its contenders.

The driver (check.py) hands a stage its settings through GC_* environment
variables; a stage's output is its log. A stage ends at the first command
that fails, with that command's exit status (as `set -e` would).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROBES = Path(__file__).resolve().parent / "probes.py"
PLUGIN_DIR = Path(__file__).resolve().parent / "pytest_plugin"  # gc_record.py, loaded with -p gc_record
DS_VERSION = "0.19.8"
LIBAIO_VERSION = "0.9.5"  # py-libaio (PyPI libaio), as fetch.sh brings it
BENCH_67M_CONTENDERS = "torch,offload-cpu,offload-nvme,fsdp2-cpu,deepspeed-cpu,deepspeed-nvme"
BENCH_1B_CONTENDERS = "torch,offload-cpu,fsdp2-cpu,deepspeed-cpu,offload-nvme,deepspeed-nvme"


@dataclass
class StageEnv:
    """What a stage is told by the driver (the GC_* variables)."""
    root: Path
    py: str  # the interpreter under test
    work: Path
    device: str  # cuda, or cpu in the CPU test mode
    workers_cuda: int
    workers_suite: int
    cuda_args: list[str]  # GPU_CHECK_CUDA_ARGS: added to cuda_tests' selection
    suite_args: list[str]
    contenders_67m: str
    contenders_1b: str
    have_ds: bool
    limit: int

    @classmethod
    def from_env(cls, env) -> StageEnv:
        return cls(root=Path(env["GC_ROOT"]), py=env["GC_PY"], work=Path(env["GC_WORK"]),
                   device=env["GC_DEVICE"], workers_cuda=int(env["GC_WORKERS_CUDA"]),
                   workers_suite=int(env["GC_WORKERS_SUITE"]), cuda_args=shlex.split(env.get("GC_CUDA_ARGS", "")),
                   suite_args=shlex.split(env.get("GC_SUITE_ARGS", "")),
                   contenders_67m=env.get("GC_67M_CONTENDERS", BENCH_67M_CONTENDERS),
                   contenders_1b=env.get("GC_1B_CONTENDERS", BENCH_1B_CONTENDERS),
                   have_ds=env.get("GC_HAVE_DS") == "1", limit=int(env.get("GC_LIMIT", "0")))

    @property
    def fetched(self) -> Path:
        return self.root / ".gpu-check"


def sh(argv: list[str], env=None, **kw) -> subprocess.CompletedProcess:
    """One command of a stage, its output in the stage's log; a failure ends the stage."""
    return subprocess.run(argv, check=True, env=env, **kw)


def importable(py: str, module: str) -> bool:
    return subprocess.run([py, "-c", f"import {module}"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def without_deepspeed(contenders: str, have_ds: bool) -> str:
    """DeepSpeed's contenders only where it imports ("where installed")."""
    if have_ds:
        return contenders
    return ",".join(c for c in contenders.split(",") if not c.startswith("deepspeed"))


# ------------------------------------------------------------------ setup
def setup_deepspeed(s: StageEnv) -> None:
    wheels = s.fetched / "wheels"
    have = subprocess.run([s.py, "-c", f"import deepspeed, sys; sys.exit(deepspeed.__version__ != '{DS_VERSION}')"],
                          stderr=subprocess.DEVNULL)
    if have.returncode == 0:
        print(f"deepspeed {DS_VERSION} already installed", flush=True)
    else:
        # DS_BUILD_OPS=0: no op at install; setup_ds_ops builds the two the bench uses.
        # --no-build-isolation: its setup.py imports the torch that is installed.
        sh([s.py, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "--no-build-isolation",
            str(wheels / f"deepspeed-{DS_VERSION}.tar.gz")], env={**os.environ, "DS_BUILD_OPS": "0"})
    sh([s.py, "-c", "import deepspeed; print('deepspeed', deepspeed.__version__, 'at', deepspeed.__file__)"])


def setup_project(s: StageEnv) -> None:
    # py-libaio: a runtime dependency (offload/requirements.py) the image lacks,
    # which the --no-deps install below would not bring; pure Python, so its
    # import needs libaio.so.1 only at run time (LD_LIBRARY_PATH has the .debs')
    sh([s.py, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(s.fetched / "wheels"),
        f"libaio=={LIBAIO_VERSION}"])
    sh([s.py, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(s.root)])
    # a silent fallback to pure PyTorch (no compiled kernels) fails here
    sh([s.py, "-c", "import offload._C as c; print('offload._C built:', c.__file__)"])
    sh([s.py, "-m", "offload", "report"])


def setup_ds_ops(s: StageEnv) -> None:
    # The two ops the DeepSpeed contenders load (cpu_adam for offload_optimizer,
    # async_io for nvme), each built in its own process so their compiles overlap.
    procs = [subprocess.Popen([s.py, str(PROBES), "op", op]) for op in ("CPUAdamBuilder", "AsyncIOBuilder")]
    if any([p.wait() != 0 for p in procs]):  # a list: wait for both before judging
        raise subprocess.CalledProcessError(1, "setup_ds_ops")


# ------------------------------------------------------------------ tests
def pytest_argv(s: StageEnv, workers: int) -> list[str]:
    """pytest with the record plugin; -n where pytest-xdist is there, a per-test
    limit where pytest-timeout is."""
    argv = [s.py, "-m", "pytest", "-p", "gc_record"]
    if importable(s.py, "xdist"):
        argv += ["-n", str(workers)]
    if importable(s.py, "pytest_timeout"):
        argv += ["--timeout=180"]
    return argv + ["-q", "-rfE"]


def record_env(s: StageEnv, name: str, env: dict) -> dict:
    """The environment of a test stage: the record plugin importable, its files emptied."""
    record = s.work / "logs" / f"{name}.record"
    for path in (record, Path(f"{record}.reports")):
        path.write_text("")
    path = env.get("PYTHONPATH")
    return {**env, "GC_RECORD": str(record), "PYTHONPATH": f"{PLUGIN_DIR}:{path}" if path else str(PLUGIN_DIR)}


def cuda_tests(s: StageEnv) -> None:
    env = record_env(s, "cuda_tests", dict(os.environ))
    env["OFFLOAD_TEST_DEVICE"] = s.device
    if s.device == "cuda":  # the CPU test mode leaves the sanitizer out: on a CPU-only torch it fails every test
        env["TORCH_CUDA_SANITIZER"] = "1"
    sh(pytest_argv(s, s.workers_cuda) + ["-m", "any_device or cuda"] + s.cuda_args, env=env)


def suite(s: StageEnv) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OFFLOAD_TEST_DEVICE", "TORCH_CUDA_SANITIZER")}
    sh(pytest_argv(s, s.workers_suite) + s.suite_args, env=record_env(s, "suite", env))


# ------------------------------------------------------------------ benches
def bench_argv(s: StageEnv, name: str) -> list[str]:
    """benchmarks/train.py for bench_67m or bench_1b, ending 10 s before the stage's
    limit (each contender gets at most what is left, train.json always written)."""
    train = [s.py, str(s.root / "benchmarks" / "train.py"), "--deadline", str(s.limit - 10)]
    if name == "bench_67m":
        shape = ["--device", "cuda"] if s.device == "cuda" else ["--device", "cpu", "--quick"]
        return train + shape + ["--contenders", without_deepspeed(s.contenders_67m, s.have_ds),
                                "--timeout", "90", "--out", str(s.work / name)]
    if s.device == "cuda":
        # ~0.94B parameters: 16 x 12 x 2048^2 in the blocks + 2 x 32000 x 2048 (untied head)
        shape = ["--model", "1b", "--device", "cuda", "--batch", "8", "--seq", "1024", "--warmup", "1",
                 "--steps", "3", "--timeout", "150"]
    else:
        shape = ["--quick", "--device", "cpu", "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "2",
                 "--timeout", "120"]
    return train + shape + ["--contenders", without_deepspeed(s.contenders_1b, s.have_ds),
                            "--out", str(s.work / name)]


def bench(s: StageEnv, name: str) -> None:
    with open(s.work / f"{name}.stdout.json", "w") as out:  # its stderr is the stage's log
        sh(bench_argv(s, name), stdout=out)


STAGES = {
    "setup_deepspeed": setup_deepspeed,
    "setup_project": setup_project,
    "setup_ds_ops": setup_ds_ops,
    "cuda_tests": cuda_tests,
    "suite": suite,
    "bench_67m": lambda s: bench(s, "bench_67m"),
    "bench_1b": lambda s: bench(s, "bench_1b"),
}


def main(name: str) -> int:
    """A stage's process: its body, then the exit status of the command that failed, if one did."""
    os.chdir(os.environ["GC_ROOT"])
    try:
        STAGES[name](StageEnv.from_env(os.environ))
    except subprocess.CalledProcessError as exc:
        # a command ended by a signal: its status as a shell gives it (139: SIGSEGV)
        return exc.returncode if exc.returncode >= 0 else 128 - exc.returncode
    except FileNotFoundError as exc:  # the interpreter or a tool is not there
        print(f"{name}: {exc}", file=sys.stderr)
        return 127
    return 0
