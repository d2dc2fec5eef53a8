#!/usr/bin/env bash
# The GPU check in one command, for the lent GPU machine (no network there):
#
#   bash benchmarks/gpu/check.sh          # from the repository root, .gpu-check/ carried
#
# Stages, each under its own `timeout`, all within GPU_CHECK_TOTAL_S (default
# 465 s, under 8 minutes); one that fails or runs out of time does not stop
# the next (benchmarks/gpu/README.md has the budget):
#   setup_deepspeed  DeepSpeed 0.19.8 from the carried sdist and wheels (--no-index)
#   setup_project    py-libaio from the carried wheel, then pip install --no-deps
#                    --no-build-isolation -e . (offload._C built), offload report
#   setup_ds_ops     DeepSpeed's cpu_adam and async_io ops built ahead (libaio from
#                    the carried .debs, unpacked under $GPU_CHECK_WORK); beside setup_project
#   cuda_tests       OFFLOAD_TEST_DEVICE=cuda TORCH_CUDA_SANITIZER=1 pytest -m "any_device or cuda"
#   suite            the whole suite as it runs by default, pytest -n 8; beside cuda_tests
#                    (both record each test's outcome as it happens, so a stage cut
#                    at its limit still names its failures and counts what finished)
#   bench_67m        offload bench train --device cuda, the default 67M model
#   bench_1b         the same at ~0.94B parameters (hidden 2048, 16 layers, vocab
#                    32000), batch 8 x seq 1024, 1 warmup + 3 timed steps
# Writes at most 8 files to $OUT (./gpu-check-out where OUT is unset): summary.txt,
# setup.log, tests.log, bench.log (log tails), train_67m.json, train_1b.json,
# train_67m.png, train_1b.png; prints the summary table last. Exit 0 when every
# stage passed, 1 when one did not, 2 when it refused to start (no CUDA, or
# .gpu-check/ missing: run benchmarks/gpu/fetch.sh where there is network).
#
# Knobs (environment):
#   GPU_CHECK_ALLOW_CPU=1   FOR TESTING THIS SCRIPT ONLY: run every stage on the
#                           CPU with tiny settings (no GPU figures come of it)
#   GPU_CHECK_STAGES        which stages, default "setup tests bench_67m bench_1b"
#                           (setup = the three setup_*; tests = cuda_tests + suite;
#                           cuda_tests or suite alone also work); an unknown word refuses
#   GPU_CHECK_TOTAL_S       the whole budget in seconds (default 465; CPU mode 2400)
#   GPU_CHECK_TESTS_CAP     cuda_tests' and suite's cap in seconds each (default 150;
#                           CPU mode 600), cut like any cap to what the budget leaves
#   GPU_CHECK_SERIAL=1      cuda_tests and then suite, not side by side
#   GPU_CHECK_PYTHON        the interpreter (default python3 on PATH)
#   GPU_CHECK_SUITE_ARGS    pytest arguments for suite (CPU mode default: a small subset)
#   GPU_CHECK_1B_CONTENDERS contenders of bench_1b, in run order
#   GPU_CHECK_WORK          full logs and bench outputs (default /tmp/gpu-check)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

GC_T0=$(date +%s)
export GC_ROOT=$PWD
export GC_FETCHED=$GC_ROOT/.gpu-check
export GC_DS_VERSION=0.19.8
export GC_LIBAIO_VERSION=0.9.5   # py-libaio (PyPI libaio), as fetch.sh brings it
export GC_CPU=${GPU_CHECK_ALLOW_CPU:-0}
export PY=${GPU_CHECK_PYTHON:-$(command -v python3 || command -v python || true)}
export GC_WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}
OUT_DIR=${OUT:-$GC_ROOT/gpu-check-out}
if [ "$GC_CPU" = 1 ]; then TOTAL_S=${GPU_CHECK_TOTAL_S:-2400}; else TOTAL_S=${GPU_CHECK_TOTAL_S:-465}; fi
DEADLINE=$((GC_T0 + TOTAL_S))
STAGES=" ${GPU_CHECK_STAGES:-setup tests bench_67m bench_1b} "

refuse() { echo "gpu-check: refused: $*" >&2; exit 2; }

for w in $STAGES; do
  case $w in
    setup|tests|cuda_tests|suite|bench_67m|bench_1b) ;;
    *) refuse "GPU_CHECK_STAGES has '$w': the values are setup, tests (or cuda_tests, suite alone), bench_67m, bench_1b" ;;
  esac
done
want() { [[ $STAGES == *" $1 "* ]]; }
# the test stages: "tests" is both
RUN_CUDA=0 RUN_SUITE=0
if want tests || want cuda_tests; then RUN_CUDA=1; fi
if want tests || want suite; then RUN_SUITE=1; fi

# ------------------------------------------------------------------ preflight
# Both refusals come at once, before anything is installed or written.
[ -n "$PY" ] || refuse "no python3 or python on PATH"
if [ "$GC_CPU" = 1 ]; then
  GPU_NAME="none (GPU_CHECK_ALLOW_CPU=1: a test of this script, on the CPU; no GPU figures)"
  echo "gpu-check: GPU_CHECK_ALLOW_CPU=1: every stage on the CPU with tiny settings, to test this script only" >&2
else
  GPU_NAME=$("$PY" - 2>&1 <<'EOF'
import sys
try:
    import torch
except Exception as exc:
    print(f"torch does not import in {sys.executable} ({type(exc).__name__}: {exc})")
    sys.exit(1)
if not torch.cuda.is_available():
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    print(f"CUDA is not available: torch {torch.__version__} ({build}) in {sys.executable} sees no GPU")
    sys.exit(1)
print(torch.cuda.get_device_name())
EOF
  ) || refuse "$(echo "$GPU_NAME" | tail -n 1); this check runs on the lent GPU machine (GPU_CHECK_ALLOW_CPU=1 runs it on the CPU, to test the script only)"
fi
lacking=()
[ -f "$GC_FETCHED/wheels/deepspeed-$GC_DS_VERSION.tar.gz" ] || lacking+=("deepspeed-$GC_DS_VERSION.tar.gz")
ls "$GC_FETCHED/wheels/libaio-$GC_LIBAIO_VERSION-"*.whl >/dev/null 2>&1 || lacking+=("py-libaio's libaio-$GC_LIBAIO_VERSION-*.whl")
ls "$GC_FETCHED"/debs/libaio-dev_*.deb >/dev/null 2>&1 || lacking+=("libaio's .debs")
if [ ${#lacking[@]} -gt 0 ]; then
  refuse ".gpu-check/ is missing or incomplete (it lacks $(printf '%s, ' "${lacking[@]}" | sed 's/, $//')): run 'bash benchmarks/gpu/fetch.sh' on a machine with network and carry [\".gpu-check\"]"
fi

ENV_LINE="device: $GPU_NAME; $(nproc) cores; $("$PY" -c 'import platform, torch; print(f"python {platform.python_version()}, torch {torch.__version__}")' 2>&1 | tail -n 1)"
case $GC_WORK in /tmp/?*|/var/tmp/?*) ;; *) refuse "GPU_CHECK_WORK must be a folder under /tmp or /var/tmp (it is emptied first), got '$GC_WORK'" ;; esac
if ! { rm -rf "$GC_WORK" && mkdir -p "$GC_WORK/results" "$GC_WORK/logs"; }; then refuse "cannot make $GC_WORK"; fi
mkdir -p "$OUT_DIR" || refuse "cannot make $OUT_DIR"
: >"$GC_WORK/order"

# libaio for DeepSpeed's async_io: headers and the .so from the carried .debs,
# found by the build (CFLAGS/LDFLAGS for DeepSpeed's compile test, CPATH and
# LIBRARY_PATH for torch's JIT build, which reads neither) and at run time.
AIO=$GC_WORK/libaio
mkdir -p "$AIO"
for deb in "$GC_FETCHED"/debs/*.deb; do
  if command -v dpkg >/dev/null; then
    dpkg -x "$deb" "$AIO"
  else  # ar + tar where dpkg is absent
    data=$(cd "$AIO" && ar t "$deb" | grep '^data\.tar')
    (cd "$AIO" && ar x "$deb" "$data" && tar -xf "$data" && rm -f "$data")
  fi
done
AIO_LIB=$(dirname "$(find "$AIO" -name 'libaio.so*' | head -n 1)")
export CFLAGS="${CFLAGS:+$CFLAGS }-I$AIO/usr/include"
export LDFLAGS="${LDFLAGS:+$LDFLAGS }-L$AIO_LIB"
export CPATH="$AIO/usr/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$AIO_LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$AIO_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ "$GC_CPU" != 1 ]; then
  # DeepSpeed 0.19.8 cannot parse the image's '9.0a' (H100 and H200 are sm_90).
  export TORCH_CUDA_ARCH_LIST=9.0
  # async_io links -lcuda: where the driver's mount has no unversioned
  # libcuda.so, the toolkit's stub serves the link (LIBRARY_PATH comes after -L).
  stubs=$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null)
  for d in "$stubs/lib64/stubs" "$stubs/targets/x86_64-linux/lib/stubs"; do
    [ -f "$d/libcuda.so" ] && { export LIBRARY_PATH="$LIBRARY_PATH:$d"; break; }
  done
fi
MAX_JOBS=$(nproc)
export MAX_JOBS
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "$GC_CPU" = 1 ]; then
  export GC_DEVICE=cpu GC_WORKERS_SUITE=2 GC_WORKERS_CUDA=2
  # DeepSpeed's ops built against the libaio under /tmp stay out of this
  # machine's ~/.cache/torch_extensions (other users' DeepSpeed loads from there)
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$GC_WORK-torch-extensions}
  CAP_SETUP=900 CAP_TESTS=${GPU_CHECK_TESTS_CAP:-600} CAP_B67=300
else
  export GC_DEVICE=cuda GC_WORKERS_SUITE=8 GC_WORKERS_CUDA=4
  # Caps per stage (s); bench_1b gets what is left. The first H200 run (16
  # cores): setup 55, both test stages cut at 150, bench_67m 74, bench_1b 115.
  CAP_SETUP=150 CAP_TESTS=${GPU_CHECK_TESTS_CAP:-150} CAP_B67=100
fi
[[ $CAP_TESTS =~ ^[0-9]+$ ]] || refuse "GPU_CHECK_TESTS_CAP must be a number of seconds, got '$CAP_TESTS'"
# cuda_tests with the suite's workers where it does not share the machine with it
if [ "${GPU_CHECK_SERIAL:-0}" = 1 ] || [ "$RUN_SUITE" = 0 ]; then GC_WORKERS_CUDA=$GC_WORKERS_SUITE; fi

# A pytest plugin (-p gc_record, importable through PYTHONPATH in the test
# stages only) that writes each test's outcome as it happens, one line each,
# to $GC_RECORD, and each failure's report to $GC_RECORD.reports: pytest names
# its failures (-rfE) only at its end, which a stage cut at its limit never
# reaches. Under pytest-xdist the controller writes (the workers' reports
# reach it), not the workers.
export GC_PLUGIN_DIR=$GC_WORK/pytest-plugin
mkdir -p "$GC_PLUGIN_DIR"
cat >"$GC_PLUGIN_DIR/gc_record.py" <<'EOF'
import os

import pytest

_out = _reports = None
_collected = False


def pytest_configure(config):
    global _out, _reports
    path = os.environ.get("GC_RECORD")
    if path and not hasattr(config, "workerinput"):  # not in an xdist worker
        # line-buffered: a run killed at its limit keeps every line written
        _out = open(path, "a", buffering=1)
        _reports = open(path + ".reports", "a", buffering=1)


def _collection(n):
    global _collected
    if _out is not None and not _collected:
        _collected = True
        _out.write(f"collected\t{n}\t\n")


def pytest_collection_finish(session):  # without xdist
    _collection(len(session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):  # xdist: every worker collects the same
    _collection(len(ids))


def pytest_runtest_logreport(report):
    if _out is None:
        return
    xfail = hasattr(report, "wasxfail")
    if report.when not in ("setup", "teardown"):  # the call, or xdist's report of a crashed worker
        kind = ("xpassed" if xfail else "passed") if report.passed else \
               ("xfailed" if xfail else "skipped") if report.skipped else "failed"
    elif report.failed:
        kind = "error"
    elif report.skipped and report.when == "setup":
        kind = "xfailed" if xfail else "skipped"
    else:
        return
    _out.write(f"{kind}\t{report.nodeid}\t{report.when}\n")
    if kind in ("failed", "error"):
        text = (report.longreprtext or "").splitlines()
        cut = f"; its last 25 of {len(text)} lines" if len(text) > 25 else ""
        _reports.write(f"----- {kind.upper()} {report.nodeid} (at {report.when}{cut})\n")
        _reports.write("\n".join(text[-25:]) + "\n")
EOF

# --------------------------------------------------------------- the stages
# Each runs as `bash -c NAME` under timeout, so its children (pytest workers,
# contenders) go with it when its time is up.
setup_deepspeed() {
  set -e
  if "$PY" -c "import deepspeed, sys; sys.exit(deepspeed.__version__ != '$GC_DS_VERSION')" 2>/dev/null; then
    echo "deepspeed $GC_DS_VERSION already installed"
  else
    # DS_BUILD_OPS=0: no op at install; setup_ds_ops builds the two the bench uses.
    # --no-build-isolation: its setup.py imports the torch that is installed.
    DS_BUILD_OPS=0 "$PY" -m pip install --no-index --find-links "$GC_FETCHED/wheels" --no-build-isolation \
      "$GC_FETCHED/wheels/deepspeed-$GC_DS_VERSION.tar.gz"
  fi
  "$PY" -c "import deepspeed; print('deepspeed', deepspeed.__version__, 'at', deepspeed.__file__)"
}

setup_project() {
  set -e
  # py-libaio: a runtime dependency (offload/requirements.py) the image lacks,
  # which the --no-deps install below would not bring; pure Python, so its
  # import needs libaio.so.1 only at run time (LD_LIBRARY_PATH has the .debs')
  "$PY" -m pip install --no-index --no-deps --find-links "$GC_FETCHED/wheels" "libaio==$GC_LIBAIO_VERSION"
  "$PY" -m pip install --no-deps --no-build-isolation -e "$GC_ROOT"
  "$PY" -c "import offload._C as c; print('offload._C built:', c.__file__)"
  "$PY" -m offload report
}

setup_ds_ops() {
  set -e
  # The two ops the DeepSpeed contenders load (cpu_adam for offload_optimizer,
  # async_io for nvme), each built in its own process so their compiles overlap;
  # torch keeps them under ~/.cache/torch_extensions for the contenders.
  local pids=() rc=0
  for op in CPUAdamBuilder AsyncIOBuilder; do
    "$PY" - "$op" <<'EOF' &
import sys, time
from deepspeed.accelerator import get_accelerator
name = sys.argv[1]
acc = get_accelerator()
builder = acc.create_op_builder(name)
if builder is None:
    sys.exit(f"{name}: accelerator {acc.device_name()} has no such op")
t = time.perf_counter()
if not builder.is_compatible(verbose=True):
    sys.exit(f"{name}: not compatible here (see the warnings above)")
builder.load(verbose=False)
print(f"op {builder.NAME}: built and loaded in {time.perf_counter() - t:.0f} s", flush=True)
EOF
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return $rc
}

pytest_common() {  # -n N where pytest-xdist is there; a per-test limit where pytest-timeout is
  local workers=$1
  "$PY" -c "import xdist" 2>/dev/null && printf -- '-n %s ' "$workers"
  "$PY" -c "import pytest_timeout" 2>/dev/null && printf -- '--timeout=180 '
  printf -- '-q -rfE'
}

record_env() {  # NAME: the plugin that records each outcome, for this test stage
  export GC_RECORD=$GC_WORK/logs/$1.record
  : >"$GC_RECORD" && : >"$GC_RECORD.reports"
  export PYTHONPATH="$GC_PLUGIN_DIR${PYTHONPATH:+:$PYTHONPATH}"
}

cuda_tests() {
  record_env cuda_tests
  # CPU mode leaves the sanitizer out: on a CPU-only torch it fails every test
  [ "$GC_DEVICE" = cuda ] && export TORCH_CUDA_SANITIZER=1
  # shellcheck disable=SC2046
  OFFLOAD_TEST_DEVICE=$GC_DEVICE "$PY" -m pytest -p gc_record $(pytest_common "$GC_WORKERS_CUDA") -m "any_device or cuda"
}

suite() {
  unset OFFLOAD_TEST_DEVICE TORCH_CUDA_SANITIZER
  record_env suite
  # eval: GC_SUITE_ARGS may hold quoted words (-m "not slow")
  eval "\"\$PY\" -m pytest -p gc_record $(pytest_common "$GC_WORKERS_SUITE") $GC_SUITE_ARGS"
}

have_deepspeed() {  # asked once after setup (an import of DeepSpeed takes seconds)
  "$PY" -c "import deepspeed" >/dev/null 2>&1 && echo 1 || echo 0
}

ds_contenders() {  # DeepSpeed's contenders only where it imports ("where installed")
  if [ "$GC_HAVE_DS" = 1 ]; then echo "$1"; else echo "$1" | tr ',' '\n' | grep -v '^deepspeed' | paste -sd,; fi
}

bench_67m() {
  local out=$GC_WORK/bench_67m contenders
  if [ "$GC_DEVICE" = cuda ]; then
    contenders=$(ds_contenders torch,offload-cpu,offload-nvme,fsdp2-cpu,deepspeed-cpu,deepspeed-nvme)
    set -- --device cuda
  else
    contenders=$(ds_contenders torch,offload-cpu,offload-nvme,fsdp2-cpu,deepspeed-cpu,deepspeed-nvme)
    set -- --device cpu --quick
  fi
  "$PY" "$GC_ROOT/benchmarks/train.py" --deadline $((GC_LIMIT - 10)) \
    "$@" --contenders "$contenders" --timeout 90 --out "$out" >"$GC_WORK/bench_67m.stdout.json"
}

bench_1b() {
  local out=$GC_WORK/bench_1b contenders
  contenders=$(ds_contenders "${GPU_CHECK_1B_CONTENDERS:-torch,offload-cpu,fsdp2-cpu,deepspeed-cpu,offload-nvme,deepspeed-nvme}")
  if [ "$GC_DEVICE" = cuda ]; then
    # ~0.94B parameters: 16 x 12 x 2048^2 in the blocks + 2 x 32000 x 2048 (untied head)
    set -- --model 1b --device cuda --batch 8 --seq 1024 --warmup 1 --steps 3 --timeout 150
  else
    set -- --quick --device cpu --batch 2 --seq 32 --warmup 1 --steps 2 --timeout 120
  fi
  "$PY" "$GC_ROOT/benchmarks/train.py" --deadline $((GC_LIMIT - 10)) "$@" \
    --contenders "$contenders" --out "$out" >"$GC_WORK/bench_1b.stdout.json"
}
export -f setup_deepspeed setup_project setup_ds_ops pytest_common record_env cuda_tests suite have_deepspeed ds_contenders bench_67m bench_1b
if [ "$GC_CPU" = 1 ]; then
  suite_default='-m "not slow" tests/config/test_config.py tests/partition/test_state_machines.py tests/test_estimate.py'
else
  suite_default=''
fi
export GC_SUITE_ARGS=${GPU_CHECK_SUITE_ARGS-$suite_default}

# ------------------------------------------------------------ stage runner
# stage NAME CAP RESERVE: runs the function NAME under `timeout`, for CAP
# seconds or what the total budget leaves after RESERVE seconds kept for the
# stages after it; records status, wall time and the limit in results/NAME.
stage() {
  local name=$1 cap=$2 reserve=$3 log=$GC_WORK/logs/$1.log
  local left=$(( DEADLINE - $(date +%s) - reserve ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 15 ]; then
    printf 'skipped\t0\t0\tno time left of the %s s budget\n' "$TOTAL_S" >"$GC_WORK/results/$name"
    echo "gpu-check: $name skipped (no time left)" >&2
    return
  fi
  echo "gpu-check: $name (limit ${limit} s) ..." >&2
  local start rc status
  start=$(date +%s)
  GC_LIMIT=$limit timeout -k 10 "$limit" bash -c "$name" >"$log" 2>&1
  rc=$?
  case $rc in
    0) status=pass ;;
    124|137) status="TIMEOUT" ;;
    *) status="FAIL rc=$rc" ;;
  esac
  printf '%s\t%s\t%s\t\n' "$status" "$(( $(date +%s) - start ))" "$limit" >"$GC_WORK/results/$name"
  echo "gpu-check: $name: $status after $(( $(date +%s) - start )) s" >&2
}

plan() {  # NAME...: the rows of the summary, in this order (stages side by side finish in any order)
  printf '%s\n' "$@" >>"$GC_WORK/order"
}

skip_stage() {  # NAME WHY
  printf 'skipped\t0\t0\t%s\n' "$2" >"$GC_WORK/results/$1"
}

# What each stage's row says besides pass/fail: test counts, op times, medians.
detail() {
  local name=$1 log=$GC_WORK/logs/$1.log
  [ -f "$log" ] || return 0
  case $name in
    cuda_tests|suite)
      grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|no tests ran' "$log" \
        | tail -n 1 | sed -E 's/^=+ //; s/ =+$//' ;;
    setup_deepspeed) grep -E '^deepspeed [0-9]' "$log" | tail -n 1 | cut -d' ' -f1-2 ;;
    setup_project) grep -q 'offload._C built' "$log" && echo "offload._C built" ;;
    setup_ds_ops) grep -E '^op .* built and loaded|has no such op|not compatible' "$log" \
        | sed -E 's/^op //; s/ built and loaded in / /' | paste -sd ';' | sed 's/;/; /g' ;;
    bench_67m|bench_1b) "$PY" - "$GC_WORK/$name/train.json" <<'EOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
res = r["results"]
ok = sum("median_s" in v for v in res.values())
skip = sum(bool(v.get("skipped")) for v in res.values())
n = r["params"]
size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n}"
print(f"{size} params, batch {r['settings']['batch']} x seq {r['settings']['seq']}: "
      f"{ok} ok, {len(res) - ok - skip} failed, {skip} skipped")
EOF
    ;;
  esac
}

# The test stages' record (the gc_record plugin's lines: KIND<TAB>NODEID<TAB>WHEN).
finished_counts() {  # NAME: "60 of 412 tests finished: 55 passed, 3 failed, ..."
  local rec=$GC_WORK/logs/$1.record log=$GC_WORK/logs/$1.log n
  if [ -s "$rec" ]; then
    awk -F'\t' '
      $1 == "collected" { if (total == "") total = $2; next }
      NF >= 2 {
        if (!($2 in seen)) { seen[$2] = 1; n++ }
        if (!(($1, $2) in had)) { had[$1, $2] = 1; c[$1]++ }
      }
      END {
        split("passed failed error skipped xfailed xpassed", kinds, " ")
        for (i = 1; i <= 6; i++) if (c[kinds[i]])
          s = s (s == "" ? "" : ", ") c[kinds[i]] " " kinds[i] (kinds[i] == "error" && c[kinds[i]] > 1 ? "s" : "")
        printf "%d%s tests finished%s\n", n, (total == "" ? "" : " of " total), (s == "" ? "" : ": " s)
      }' "$rec"
  elif [ -f "$log" ]; then  # no record (the plugin did not load): pytest -q's progress letters
    n=$(grep -E '^[.FEsxX]+ *(\[ *[0-9]+%\])?$' "$log" | sed -E 's/ *\[.*$//' | tr -d '\n' | wc -c)
    echo "$n tests finished (counted from pytest's progress letters)"
  fi
}

failed_ids() {  # NAME: each failed or erroring test once, in the order it happened
  local rec=$GC_WORK/logs/$1.record
  [ -s "$rec" ] || return 0
  awk -F'\t' '($1 == "failed" || $1 == "error") && !seen[$2]++ {
    if ($1 == "failed") print "FAILED " $2; else print "ERROR  " $2 " (at " $3 ")" }' "$rec"
}

failed_lines() {  # NAME MAX: the summary's lines under a test stage's row
  local n
  n=$(failed_ids "$1" | wc -l)
  [ "$n" -gt 0 ] || return 0
  failed_ids "$1" | head -n "$2" | sed 's/^/    /'
  [ "$n" -le "$2" ] || echo "    ... and $((n - $2)) more: tests.log names them all"
}

# One line per contender under a bench stage's row.
contender_lines() {
  local json=$GC_WORK/$1/train.json
  [ -f "$json" ] || return 0
  "$PY" - "$json" <<'EOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
for name, v in r["results"].items():
    if "median_s" in v:
        line = f"{v['median_s']:.3f} s/step (median of {len(v['step_times_s'])}), {v['tokens_per_s']:.0f} tok/s, " \
               f"{v['tflops']:.3g} TFLOPS, RSS {v['peak_rss_bytes'] / 2**30:.1f} GiB"
        if "peak_gpu_bytes" in v:
            line += f", GPU {v['peak_gpu_bytes'] / 2**30:.1f} GiB"
        print(f"    {name:<16} ok    {line}")
    else:
        state = "skip" if v.get("skipped") else "FAIL"
        print(f"    {name:<16} {state}  {str(v.get('error'))[:110]}")
EOF
}

summary() {
  local now name status wall limit extra
  now=$(date +%s)
  {
    echo "== gpu-check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ)) =="
    echo "$ENV_LINE"
    printf '%-16s %-12s %7s %7s  %s\n' stage status wall_s limit_s "counts / medians"
    while read -r name; do
      IFS=$'\t' read -r status wall limit extra <"$GC_WORK/results/$name" || continue
      [ -n "$extra" ] || extra=$(detail "$name")
      # a test stage cut short (no closing line of pytest's): what its record says
      [[ $name == cuda_tests || $name == suite ]] && [[ $status == TIMEOUT || -z $extra ]] &&
        extra=$(finished_counts "$name")
      [ "$status" = TIMEOUT ] && extra="stopped at its ${limit} s limit${extra:+; $extra}"
      # a bench whose only misses are contenders skipped for time
      [[ $name == bench_* && $status == "FAIL rc=1" && $extra == *", 0 failed, "[1-9]* ]] && status=partial
      printf '%-16s %-12s %7s %7s  %s\n' "$name" "$status" "$wall" "$limit" "$extra"
      case $name in
        bench_*) contender_lines "$name" ;;
        cuda_tests|suite) failed_lines "$name" 15 ;;
      esac
    done <"$GC_WORK/order"
    # shellcheck disable=SC2012  # our own file names
    echo "total: $(( now - GC_T0 )) s of the ${TOTAL_S} s budget; files in $OUT_DIR: $(cd "$OUT_DIR" && ls | paste -sd' ')"
  }
}

tail_lines() {  # FILE LINES: its last lines, ending in a newline (one killed mid-line does not)
  tail -n "$2" "$1"
  [ -z "$(tail -c 1 "$1")" ] || echo
}

tail_section() {  # TITLE FILE LINES
  [ -f "$2" ] || return 0
  echo "===== $1 (last $3 lines of $(wc -l <"$2")) ====="
  tail_lines "$2" "$3"
}

test_section() {  # NAME: tests.log's part for a test stage
  local name=$1 log=$GC_WORK/logs/$1.log rec=$GC_WORK/logs/$1.record n
  [ -f "$log" ] || return 0
  echo "===== $name: $(cut -f1 "$GC_WORK/results/$name" 2>/dev/null || echo running); $(finished_counts "$name") ====="
  if [ -s "$rec" ]; then
    n=$(failed_ids "$name" | wc -l)
    echo "--- failed or erroring, in the order they happened ($n) ---"
    failed_ids "$name" | head -n 200
    [ "$n" -le 200 ] || echo "... and $((n - 200)) more ($rec on the machine)"
    if [ -s "$rec.reports" ]; then
      echo "--- the first 15 of their reports, as they happened ---"
      awk '/^----- (FAILED|ERROR) / { k++ } k <= 15' "$rec.reports"
    fi
  fi
  echo "--- the log's last 200 lines (of $(wc -l <"$log")) ---"
  tail_lines "$log" 200
}

# Copies what there is so far to $OUT (8 files at most), after every stage, so
# a run cut short still leaves its figures.
publish() {
  local L=$GC_WORK/logs
  {
    tail_section setup_deepspeed "$L/setup_deepspeed.log" 120
    tail_section setup_project "$L/setup_project.log" 120
    tail_section setup_ds_ops "$L/setup_ds_ops.log" 120
  } >"$OUT_DIR/setup.log"
  {
    test_section cuda_tests
    test_section suite
  } >"$OUT_DIR/tests.log"
  {
    tail_section bench_67m "$L/bench_67m.log" 250
    tail_section bench_1b "$L/bench_1b.log" 250
  } >"$OUT_DIR/bench.log"
  local b
  for b in 67m 1b; do
    [ -f "$GC_WORK/bench_$b/train.json" ] && cp "$GC_WORK/bench_$b/train.json" "$OUT_DIR/train_$b.json"
    [ -f "$GC_WORK/bench_$b/train.png" ] && cp "$GC_WORK/bench_$b/train.png" "$OUT_DIR/train_$b.png"
  done
  summary >"$OUT_DIR/summary.txt"
}

# ------------------------------------------------------------------- run
{
  echo "gpu-check: $GPU_NAME; python $PY; out $OUT_DIR; budget ${TOTAL_S} s"
  [ "$GC_CPU" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  df -h "$GC_ROOT" 2>/dev/null | tail -n 1
} >&2

# Reserves: what the selected stages after each one need at the least (60 s
# bench_1b, 60 s bench_67m, 120 s the tests, 60 s setup after setup_deepspeed).
R_B1B=0 R_B67=0 R_TESTS=0
want bench_1b && R_B1B=60                 # kept for bench_1b by the stages before it
R_B67=$R_B1B
want bench_67m && R_B67=$((R_B67 + 60))   # kept by the tests for the benches
R_TESTS=$R_B67
[ "$RUN_CUDA$RUN_SUITE" != 00 ] && R_TESTS=$((R_TESTS + 120))  # kept by setup for what follows
if want setup; then
  plan setup_deepspeed setup_project setup_ds_ops
  stage setup_deepspeed 90 $((60 + R_TESTS))
  # the project's build beside DeepSpeed's op builds: they share no file
  stage setup_project "$CAP_SETUP" "$R_TESTS" &
  if [ "$(have_deepspeed)" = 1 ]; then
    stage setup_ds_ops "$CAP_SETUP" "$R_TESTS" &
  else
    skip_stage setup_ds_ops "deepspeed does not import"
  fi
  wait
  publish
fi
export GC_HAVE_DS
GC_HAVE_DS=$(have_deepspeed)
if [ "$RUN_CUDA$RUN_SUITE" = 11 ]; then
  plan cuda_tests suite
  if [ "${GPU_CHECK_SERIAL:-0}" = 1 ]; then
    stage cuda_tests "$CAP_TESTS" $((30 + R_B67))
    stage suite "$CAP_TESTS" "$R_B67"
  else
    # side by side: the cuda subset is GPU-bound, the suite runs on the host
    stage cuda_tests "$CAP_TESTS" "$R_B67" &
    stage suite "$CAP_TESTS" "$R_B67" &
    wait
  fi
  publish
elif [ "$RUN_CUDA" = 1 ]; then
  plan cuda_tests
  stage cuda_tests "$CAP_TESTS" "$R_B67"
  publish
elif [ "$RUN_SUITE" = 1 ]; then
  plan suite
  stage suite "$CAP_TESTS" "$R_B67"
  publish
fi
if want bench_67m; then
  plan bench_67m
  stage bench_67m "$CAP_B67" "$R_B1B"
  publish
fi
if want bench_1b; then
  plan bench_1b
  stage bench_1b 100000 5
  publish
fi

summary >"$OUT_DIR/summary.txt"
echo >&2
cat "$OUT_DIR/summary.txt"
ok=1
while read -r name; do
  [[ $(cut -f1 "$GC_WORK/results/$name") == pass ]] || ok=0
done <"$GC_WORK/order"
[ $ok = 1 ]
