#!/usr/bin/env bash
# The GPU check in one command, for the lent GPU machine (no network there):
#
#   bash benchmarks/gpu/check.sh          # from the repository root, .gpu-check/ carried
#
# Stages, each under its own `timeout`, all within GPU_CHECK_TOTAL_S (default
# 465 s, under 8 minutes); one that fails or runs out of time does not stop
# the next (benchmarks/gpu/README.md has the budget):
#   setup_deepspeed  DeepSpeed 0.19.8 from the carried sdist and wheels (--no-index)
#   setup_project    pip install --no-deps --no-build-isolation -e . (offload._C built)
#   setup_ds_ops     DeepSpeed's cpu_adam and async_io ops built ahead (libaio from
#                    the carried .debs, unpacked under $GPU_CHECK_WORK); beside setup_project
#   cuda_tests       OFFLOAD_TEST_DEVICE=cuda TORCH_CUDA_SANITIZER=1 pytest -m "any_device or cuda"
#   suite            the whole suite as it runs by default, pytest -n 8; beside cuda_tests
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
#                           (setup = the three setup_*; tests = cuda_tests + suite)
#   GPU_CHECK_TOTAL_S       the whole budget in seconds (default 465; CPU mode 2400)
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
export GC_CPU=${GPU_CHECK_ALLOW_CPU:-0}
export PY=${GPU_CHECK_PYTHON:-$(command -v python3 || command -v python || true)}
export GC_WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}
OUT_DIR=${OUT:-$GC_ROOT/gpu-check-out}
if [ "$GC_CPU" = 1 ]; then TOTAL_S=${GPU_CHECK_TOTAL_S:-2400}; else TOTAL_S=${GPU_CHECK_TOTAL_S:-465}; fi
DEADLINE=$((GC_T0 + TOTAL_S))
STAGES=" ${GPU_CHECK_STAGES:-setup tests bench_67m bench_1b} "

refuse() { echo "gpu-check: refused: $*" >&2; exit 2; }

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
if [ ! -f "$GC_FETCHED/wheels/deepspeed-$GC_DS_VERSION.tar.gz" ] || ! ls "$GC_FETCHED"/debs/libaio-dev_*.deb >/dev/null 2>&1; then
  refuse ".gpu-check/ is missing or incomplete (no deepspeed-$GC_DS_VERSION.tar.gz or libaio .debs): run 'bash benchmarks/gpu/fetch.sh' on a machine with network and carry [\".gpu-check\"]"
fi

ENV_LINE="device: $GPU_NAME; $(nproc) cores; $("$PY" -c 'import platform, torch; print(f"python {platform.python_version()}, torch {torch.__version__}")' 2>&1 | tail -n 1)"
case $GC_WORK in /tmp/?*|/var/tmp/?*) ;; *) refuse "GPU_CHECK_WORK must be a folder under /tmp or /var/tmp (it is emptied first), got '$GC_WORK'" ;; esac
rm -rf "$GC_WORK" && mkdir -p "$GC_WORK/results" "$GC_WORK/logs" || refuse "cannot make $GC_WORK"
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
export MAX_JOBS=$(nproc)
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "$GC_CPU" = 1 ]; then
  export GC_DEVICE=cpu GC_WORKERS_SUITE=2 GC_WORKERS_CUDA=2
  # DeepSpeed's ops built against the libaio under /tmp stay out of this
  # machine's ~/.cache/torch_extensions (other users' DeepSpeed loads from there)
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$GC_WORK-torch-extensions}
  CAP_SETUP=900 CAP_TESTS=600 CAP_B67=300
else
  export GC_DEVICE=cuda GC_WORKERS_SUITE=8 GC_WORKERS_CUDA=4
  # Caps per stage (s); bench_1b gets what is left. Expected on 16 cores:
  # setup ~90, tests ~120, bench_67m ~80, leaving bench_1b ~3 min.
  CAP_SETUP=150 CAP_TESTS=150 CAP_B67=100
fi
[ "${GPU_CHECK_SERIAL:-0}" = 1 ] && GC_WORKERS_CUDA=$GC_WORKERS_SUITE

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

cuda_tests() {
  # shellcheck disable=SC2046
  # CPU mode leaves the sanitizer out: on a CPU-only torch it fails every test
  [ "$GC_DEVICE" = cuda ] && export TORCH_CUDA_SANITIZER=1
  OFFLOAD_TEST_DEVICE=$GC_DEVICE "$PY" -m pytest $(pytest_common "$GC_WORKERS_CUDA") -m "any_device or cuda"
}

suite() {
  unset OFFLOAD_TEST_DEVICE TORCH_CUDA_SANITIZER
  # eval: GC_SUITE_ARGS may hold quoted words (-m "not slow")
  eval "\"\$PY\" -m pytest $(pytest_common "$GC_WORKERS_SUITE") $GC_SUITE_ARGS"
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
export -f setup_deepspeed setup_project setup_ds_ops pytest_common cuda_tests suite have_deepspeed ds_contenders bench_67m bench_1b
if [ "$GC_CPU" = 1 ]; then
  suite_default='-m "not slow" tests/test_config.py tests/test_state_machines.py tests/test_estimate.py'
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
      [ "$status" = TIMEOUT ] && extra="stopped at its ${limit} s limit${extra:+; $extra}"
      # a bench whose only misses are contenders skipped for time
      [[ $name == bench_* && $status == "FAIL rc=1" && $extra == *", 0 failed, "[1-9]* ]] && status=partial
      printf '%-16s %-12s %7s %7s  %s\n' "$name" "$status" "$wall" "$limit" "$extra"
      case $name in bench_*) contender_lines "$name" ;; esac
    done <"$GC_WORK/order"
    echo "total: $(( now - GC_T0 )) s of the ${TOTAL_S} s budget; files in $OUT_DIR: $(cd "$OUT_DIR" && ls | paste -sd' ')"
  }
}

tail_section() {  # TITLE FILE LINES
  [ -f "$2" ] || return 0
  echo "===== $1 (last $3 lines of $(wc -l <"$2")) ====="
  tail -n "$3" "$2"
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
    tail_section cuda_tests "$L/cuda_tests.log" 400
    tail_section suite "$L/suite.log" 400
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

# Reserves: what the stages after each one need at the least.
if [[ $STAGES == *" setup "* ]]; then
  plan setup_deepspeed setup_project setup_ds_ops
  stage setup_deepspeed 90 300
  # the project's build beside DeepSpeed's op builds: they share no file
  stage setup_project "$CAP_SETUP" 240 &
  if [ "$(have_deepspeed)" = 1 ]; then
    stage setup_ds_ops "$CAP_SETUP" 240 &
  else
    skip_stage setup_ds_ops "deepspeed does not import"
  fi
  wait
  publish
fi
export GC_HAVE_DS
GC_HAVE_DS=$(have_deepspeed)
if [[ $STAGES == *" tests "* ]]; then
  plan cuda_tests suite
  if [ "${GPU_CHECK_SERIAL:-0}" = 1 ]; then
    stage cuda_tests "$CAP_TESTS" 150
    stage suite "$CAP_TESTS" 120
  else
    # side by side: the cuda subset is GPU-bound, the suite runs on the host
    stage cuda_tests "$CAP_TESTS" 120 &
    stage suite "$CAP_TESTS" 120 &
    wait
  fi
  publish
fi
if [[ $STAGES == *" bench_67m "* ]]; then
  plan bench_67m
  stage bench_67m "$CAP_B67" 60
  publish
fi
if [[ $STAGES == *" bench_1b "* ]]; then
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
