"""step-check: the offloaded step on a GPU, measured in one call
(`bash benchmarks/gpu/step_check.sh`), what matters first.

Parts (benchmarks/gpu/README.md has the table): setup or project first, then
1b_fp32, 1b_bf16, 1b_compile, 67m, adam_ref and tests in the order STEP_CHECK_PARTS names them,
each keeping back the least the parts named after it need. Each part writes
its files to $OUT as it ends, so a call cut short still returns what it had.
Exit status: 0 every part ran and passed, 1 one did not, 2 refused to start.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from gpucheck import budget, stages
from gpucheck.budget import Budget
from gpucheck.check import PACKAGE_DIR, ROOT, Refused, knob, nproc, probe, seconds, tmp_folder
from gpucheck.summary import last_lines, read

PARTS = ("setup", "project", "1b_fp32", "1b_bf16", "1b_compile", "7b", "67m", "adam_ref", "tests")
JSONS = ("train_1b_fp32.json", "train_1b_bf16.json", "train_1b_compile.json", "train_7b.json", "train_67m.json")


def with_24gb(precision: str, value: str) -> bool:
    """STEP_CHECK_24GB: the precisions with an offload-auto run at a 24 GB card's budget
    ("fp32 bf16" by default; "1" both, "0" none)."""
    return f" {precision} " in f" {value} " or f" {value} " == " 1 "


def merge_24gb(first: Path, second: Path) -> None:
    """Each contender run at 24 GB joins the first run's JSON as NAME-24GB (the same machine, minutes apart)."""
    r = json.loads(first.read_text()) if first.exists() else {"results": {}}
    for name, res in json.loads(second.read_text())["results"].items():
        r["results"][f"{name}-24GB"] = res
    first.write_text(json.dumps(r, indent=1))


def report(out: Path) -> list[str]:
    """Each contender's median step, peak memory, and for ours the step's critical
    path and its bus bytes and seconds a step, from the JSONs in $OUT."""
    lines = []
    for f in JSONS:
        path = out / f
        if not path.exists():
            continue
        try:
            r = json.loads(read(path))
            lines.append(f"== {f}: {r.get('params', 0) / 1e9:.3f}B params")
            for name, v in r["results"].items():
                lines.append(contender(name, v))
        except Exception as exc:  # a JSON cut short says so and the rest still reports
            lines.append(f"  {f}: unreadable ({type(exc).__name__}: {exc})")
    return lines


def adam_reference_lines(out: Path) -> list[str]:
    """The host update against torch's AdamW on the device, per form: the share of
    elements that differ, the largest difference in ulps and the relative error (the worst step)."""
    path = out / "adam_reference.json"
    if not path.exists():
        return []
    try:
        r = json.loads(read(path))
        lines = [f"== adam_reference.json: {r['size']:,} elements, {r['steps']} steps, host sqrt {r['host_sqrt']}"]
        for form, tensors in r["worst_step"].items():
            lines.append(f"  torch {form:<8} on {r['device']}: " + ", ".join(
                f"{t} {100 * v['share']:.3f}% differ (max {v['max_ulps']} ulps"
                + (f", rel {v['rel_error']:.1e})" if "rel_error" in v else ")") for t, v in tensors.items()))
        return lines
    except Exception as exc:
        return [f"  adam_reference.json: unreadable ({type(exc).__name__}: {exc})"]


def contender(name: str, v: dict) -> str:
    if "median_s" not in v:
        why = str(v.get("error") or v.get("reason"))[:160]
        return f"  {name:<18} {'skipped' if v.get('skipped') else 'FAILED'}: {why}"
    line = (f"  {name:<18} {v['median_s']:.3f} s  GPU {v.get('peak_gpu_bytes', 0) / 2**30:.1f} GiB"
            f"  RSS {v['peak_rss_bytes'] / 2**30:.1f} GiB")
    steps = v.get("timeline_per_step") or []
    if steps:
        cp = v["critical_path_median"]
        bus = [s.get("bus", {}) for s in steps]

        def med(k):
            return statistics.median(b.get(k, 0) for b in bus)

        line += (f"  compute {cp['compute_s']:.3f} wait {cp['wait_s']:.3f} opt {cp['optimizer_s']:.3f}"
                 f" adam {statistics.median(s['optimizer_gparams_per_s'] for s in steps):.2f} G/s"
                 f"  up {med('up_bytes') / 1e9:.2f} GB {med('up_s'):.3f} s down {med('down_bytes') / 1e9:.2f} GB"
                 f" {med('down_s'):.3f} s  rate {v.get('bus_rate_gbps')}")
    return line + f"  losses {[round(x, 4) for x in v.get('losses', [])][:4]}"


class Step:
    def __init__(self, env, t0: float):
        self.cpu = knob(env, "STEP_CHECK_ALLOW_CPU", "0") == "1"
        parts = knob(env, "STEP_CHECK_PARTS", "setup 1b_fp32 1b_bf16 67m adam_ref tests").split()
        for w in parts:
            if w not in PARTS:
                raise Refused(f"STEP_CHECK_PARTS has '{w}' ({', '.join(PARTS)})")
        self.parts = parts
        self.budget = Budget(seconds(env, "STEP_CHECK_TOTAL_S", 1500 if self.cpu else 575), t0)
        self.work = Path(tmp_folder(knob(env, "STEP_CHECK_WORK", "/tmp/step-check"), "STEP_CHECK_WORK"))
        self.out = Path(knob(env, "OUT", str(ROOT / "gpu-check-out")))
        self.py = knob(env, "GPU_CHECK_PYTHON", sys.executable or "python3")
        self.knobs = env
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        if self.cpu:
            self.env["GPU_CHECK_ALLOW_CPU"] = "1"
            self.dev, self.one_b_shape, self.small = (["--device", "cpu"], ["--quick", "--batch", "2", "--seq", "32",
                                                      "--warmup", "1", "--steps", "2"], ["--quick"])
            self.seven_b_shape = ["--quick", "--batch", "2", "--seq", "32", "--warmup", "1", "--steps", "2"]
        else:
            self.dev, self.one_b_shape, self.small = (["--device", "cuda"], ["--model", "1b", "--batch", "8", "--seq",
                                                      "1024", "--warmup", "1", "--steps", "3"], ["--steps", "6"])
            # Llama-2 7B's width at 42 of this GPT's layers: 6.89B parameters, 110 GB of fp32
            # state, which the H200 holds for torch beside 4096 tokens' checkpointed activations.
            self.seven_b_shape = ["--model", "7b", "--layers", "42", "--batch", "4", "--seq", "1024",
                                  "--warmup", "1", "--steps", "2", "--init-device", "cuda"]
        self.notes: list[str] = []
        self.failed: list[str] = []
        self._have_ds = None
        self.device_line = ""

    # ------------------------------------------------------------ helpers
    def note(self, text: str) -> None:
        print(f"step-check: {text}", file=sys.stderr, flush=True)
        self.notes.append(f"step-check: {text}")

    def have_ds(self) -> bool:  # asked once, where a DeepSpeed contender is named
        if self._have_ds is None:
            self._have_ds = stages.importable(self.py, "deepspeed")
        return self._have_ds

    def ds(self, contenders: str) -> str:
        if not any(c.startswith("deepspeed") for c in contenders.split(",")):
            return contenders
        return stages.without_deepspeed(contenders, self.have_ds())

    def check(self, log: Path, **knobs: str) -> int:
        """check.py run as a part of this one (its setup, its cuda_tests), its output to log."""
        with open(log, "w") as f:  # no limit of ours: it keeps to the budget it is given
            return budget.run_limited([sys.executable, str(PACKAGE_DIR), "check"], None, stdout=f,
                                      env={**self.env, **knobs})

    def cat(self, dest: Path, *sources: Path) -> None:
        dest.write_text("".join(read(p) for p in sources if p.is_file()))

    def write_summary(self) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        lines = [f"== step-check {stamp}, {nproc()} cores, {self.device_line}", *self.notes, *report(self.out),
                 *adam_reference_lines(self.out)]
        (self.out / "summary.txt").write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------ parts
    def setup(self) -> None:
        rc = self.check(self.work / "setup.stdout", GPU_CHECK_STAGES="setup", OUT=str(self.work / "setup-out"),
                        GPU_CHECK_TOTAL_S=str(max(0, min(self.budget.left(), 170))))
        self.note(f"setup exit {rc} after {self.budget.elapsed()} s")
        self.cat(self.out / "setup.log", self.work / "setup-out" / "summary.txt", self.work / "setup-out" / "setup.log")
        if rc:
            self.failed.append("setup")

    def project(self) -> None:
        """The project alone (py-libaio, pip install -e .): ours again on a fresh machine, without DeepSpeed."""
        rc = 0
        with open(self.out / "setup.log", "w") as log:
            for argv in ([self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                          str(ROOT / ".gpu-check" / "wheels"), f"libaio=={stages.LIBAIO_VERSION}"],
                         [self.py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
                         [self.py, "-c", "import offload._C"]):
                rc = budget.run_limited(argv, None, stdout=log, env=self.env)
                if rc:
                    break
        self.note(f"project exit {rc} after {self.budget.elapsed()} s")
        if rc:
            self.failed.append("project")

    def bench_env(self) -> None:
        """What check's benches run under: libaio from the carried .debs as check's setup
        unpacked it (DeepSpeed's async_io test compiles against it at run time too, and
        py-libaio loads it), and the arch list DeepSpeed's ops were built with."""
        aio = Path(knob(self.knobs, "GPU_CHECK_WORK", "/tmp/gpu-check")) / "libaio"
        found = sorted(Path(d) for d, _, files in os.walk(aio) if any(f.startswith("libaio.so") for f in files))
        if found:
            ld = self.env.get("LD_LIBRARY_PATH")
            self.env.update(LD_LIBRARY_PATH=f"{found[0]}:{ld}" if ld else str(found[0]),
                            CFLAGS=f"-I{aio}/usr/include", LDFLAGS=f"-L{found[0]}", CPATH=f"{aio}/usr/include",
                            LIBRARY_PATH=str(found[0]))
        if self.cpu:
            self.env["TORCH_EXTENSIONS_DIR"] = "/tmp/gpu-check-torch-extensions"
        else:
            self.env["TORCH_CUDA_ARCH_LIST"] = "9.0"

    def bench(self, name: str, keep: int, args: list[str]) -> int | None:
        """benchmarks/train.py within what the budget leaves after `keep` s; None where skipped."""
        limit = self.budget.left() - keep
        if limit < budget.MIN_BENCH_S:
            self.note(f"{name} skipped ({self.budget.left()} s left)")
            self.failed.append(name)
            return None
        t = int(self.budget.clock())
        argv = [self.py, str(ROOT / "benchmarks" / "train.py"), *self.dev, "--deadline", str(limit - 5), *args,
                "--out", str(self.work / name)]
        with open(self.work / f"{name}.json", "w") as out, open(self.work / f"{name}.err", "w") as err:
            rc = budget.run_limited(argv, limit, stdout=out, stderr=err, env=self.env, kill_after=5)
        self.note(f"{name} exit {rc} after {int(self.budget.clock()) - t} s")
        with open(self.out / "bench.log", "a") as log:
            log.write(f"===== {name} (last 80 lines)\n" + last_lines(read(self.work / f"{name}.err"), 80))
        if rc:
            self.failed.append(name)
        return rc

    def one_b(self, p: str, keep: int, contenders: str) -> None:
        """The 1B contenders in precision p, then offload-auto with a 24 GB card's budget."""
        first, dest = self.work / f"1b_{p}" / "train.json", self.out / f"train_1b_{p}.json"
        with24 = with_24gb(p, knob(self.knobs, "STEP_CHECK_24GB", "fp32 bf16"))
        self.bench(f"1b_{p}", keep + 45 * with24,
                   [*self.one_b_shape, "--precision", p, "--timeout", "150", "--contenders", self.ds(contenders)])
        if first.exists():
            shutil.copyfile(first, dest)
        if not with24:
            return
        if self.bench(f"1b_{p}_24gb", keep, [*self.one_b_shape, "--precision", p, "--timeout", "120",
                                              "--contenders", knob(self.knobs, "STEP_CHECK_24GB_CONTENDERS",
                                                                   "offload-auto"),
                                              "--device-budget", "24GB"]) is None:
            return
        try:
            merge_24gb(first, self.work / f"1b_{p}_24gb" / "train.json")
            shutil.copyfile(first, dest)
        except Exception as exc:
            print(f"step-check: 1b_{p}_24gb not merged ({type(exc).__name__}: {exc})", file=sys.stderr)

    def adam_reference(self, keep: int) -> None:
        """`offload bench adam-reference`: the host update against torch's AdamW on the device,
        element by element (Note [which AdamW the host update equals])."""
        limit = self.budget.left() - keep
        if limit < 20:
            self.note(f"adam_ref skipped ({self.budget.left()} s left)")
            self.failed.append("adam_ref")
            return
        size = "64K" if self.cpu else "16M"
        argv = [self.py, "-m", "offload", "bench", "adam-reference", *self.dev, "--size", size, "--steps", "10",
                "--out", str(self.work / "adam_ref")]
        with open(self.work / "adam_ref.stdout", "w") as out, open(self.work / "adam_ref.err", "w") as err:
            rc = budget.run_limited(argv, limit, stdout=out, stderr=err, env=self.env, kill_after=5)
        self.note(f"adam_ref exit {rc}")
        if (self.work / "adam_ref" / "adam_reference.json").exists():
            shutil.copyfile(self.work / "adam_ref" / "adam_reference.json", self.out / "adam_reference.json")
        if rc:
            self.failed.append("adam_ref")

    def tests(self) -> None:
        """check's cuda_tests for what the budget leaves."""
        left = self.budget.left()
        if left < 30:
            self.note(f"tests skipped ({left} s left)")
            self.failed.append("tests")
            return
        rc = self.check(self.work / "tests.stdout", GPU_CHECK_STAGES="cuda_tests", GPU_CHECK_TOTAL_S=str(left),
                        GPU_CHECK_TESTS_CAP=str(left), GPU_CHECK_WORK=str(self.work / "gpu-check-tests"),
                        OUT=str(self.work / "tests-out"))
        self.note(f"tests exit {rc} after {self.budget.elapsed()} s in all")
        self.cat(self.out / "tests.log", self.work / "tests-out" / "summary.txt", self.work / "tests-out" / "tests.log")
        if rc:
            self.failed.append("tests")

    def run(self) -> int:
        shutil.rmtree(self.work, ignore_errors=True)
        try:
            self.work.mkdir(parents=True)
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"step-check: refused: cannot make its folders ({exc})", file=sys.stderr)
            return 2
        (self.out / "bench.log").unlink(missing_ok=True)  # this run's benches only
        self.device_line = probe(self.py, "device")[1]
        for first in ("setup", "project"):  # setup or project first, whatever the order named
            if first in self.parts:
                getattr(self, first)()
                self.write_summary()
        self.bench_env()
        for part in self.parts:
            keep = budget.step_keep(self.parts, part)
            if part == "1b_fp32":
                self.one_b("fp32", keep, knob(self.knobs, "STEP_CHECK_1B_FP32",
                                              "torch,offload-cpu,offload-auto,deepspeed-cpu"))
            elif part == "1b_bf16":  # DeepSpeed's bf16 step is not a target
                self.one_b("bf16", keep, knob(self.knobs, "STEP_CHECK_1B_BF16", "torch,offload-cpu,offload-auto"))
            elif part == "1b_compile":  # blocks compiled (inductor) beside eager, bf16 (Note [compiled blocks])
                self.bench("1b_compile", keep, [*self.one_b_shape, "--precision", "bf16", "--timeout", "240",
                                                 "--compile", "--contenders",
                                                 knob(self.knobs, "STEP_CHECK_1B_COMPILE", "torch,offload-auto")])
                if (self.work / "1b_compile" / "train.json").exists():
                    shutil.copyfile(self.work / "1b_compile" / "train.json", self.out / "train_1b_compile.json")
            elif part == "7b":  # a full fine-tune: ours within a 24 GB card's budget, torch with the card's all
                self.bench("7b", keep, [*self.seven_b_shape, "--precision", "fp32", "--checkpoint", "--timeout", "300",
                                        "--device-budget", knob(self.knobs, "STEP_CHECK_7B_BUDGET", "24GB"),
                                        "--contenders", knob(self.knobs, "STEP_CHECK_7B", "torch,offload-cpu")])
                if (self.work / "7b" / "train.json").exists():
                    shutil.copyfile(self.work / "7b" / "train.json", self.out / "train_7b.json")
            elif part == "67m":
                self.bench("67m", keep, [*self.small, "--timeout", "80", "--contenders", self.ds(knob(
                    self.knobs, "STEP_CHECK_67M", "torch,offload-cpu,offload-nvme,deepspeed-cpu,deepspeed-nvme"))])
                if (self.work / "67m" / "train.json").exists():
                    shutil.copyfile(self.work / "67m" / "train.json", self.out / "train_67m.json")
            elif part == "adam_ref":
                self.adam_reference(keep)
            elif part == "tests":
                self.tests()
            else:
                continue
            self.write_summary()
        self.write_summary()
        print((self.out / "summary.txt").read_text(), end="", flush=True)
        return 1 if self.failed else 0


def main(env=None) -> int:
    env = os.environ if env is None else env
    t0 = time.time()
    budget.end_all_when_stopped()
    os.chdir(ROOT)
    try:
        step = Step(env, t0)
    except Refused as exc:
        print(f"step-check: refused: {exc}", file=sys.stderr)
        return 2
    return step.run()
