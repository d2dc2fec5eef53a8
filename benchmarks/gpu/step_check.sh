#!/usr/bin/env bash
# The offloaded step on a GPU, measured in one device call (.gpu-check/ carried,
# as for check.sh), what matters first; each part writes its files as it ends,
# so a call cut short still returns what it had:
#   setup     check.sh's setup (DeepSpeed, the project, DeepSpeed's ops)
#   project   the project alone (py-libaio, pip install -e .: ~30 s), for a rerun of
#             ours without DeepSpeed on a fresh machine, in place of setup
#   1b_fp32   GPT 0.94B, batch 8 x seq 1024: torch in GPU memory, offload-cpu,
#             offload-auto (the card's default budget), deepspeed-cpu; then
#             offload-auto with a 24 GB card's budget (--device-budget 24GB)
#   1b_bf16   the same with --precision bf16, without DeepSpeed
#   67m       the default 67M model: torch, offload-cpu, offload-nvme,
#             deepspeed-cpu, deepspeed-nvme
#   tests     check.sh's cuda_tests (OFFLOAD_TEST_DEVICE=cuda under
#             TORCH_CUDA_SANITIZER=1) for what the budget leaves
# Our contenders' JSON holds each timed step's critical path (compute, waits,
# Adam's rate) and its bus bytes and seconds each way, beside a 1 GiB pinned
# copy's rate each way (bus_rate_gbps): benchmarks/gpu/README.md.
#
#   run(command="bash benchmarks/gpu/step_check.sh", carry=[".gpu-check"], timeout_s=600)
#
# Knobs: STEP_CHECK_PARTS (default "setup 1b_fp32 1b_bf16 67m tests"; setup or
# project first, the others in the order named; a rerun on a fresh machine keeps setup), STEP_CHECK_TOTAL_S (default 575), STEP_CHECK_1B_FP32
# (default torch,offload-cpu,offload-auto,deepspeed-cpu), STEP_CHECK_1B_BF16 (default
# torch,offload-cpu,offload-auto: DeepSpeed's bf16 step is not a target),
# STEP_CHECK_24GB (the precisions with an offload-auto run at a 24 GB card's budget,
# default "fp32 bf16"; 0: none),
# STEP_CHECK_ALLOW_CPU=1 (a test of this script on the CPU, tiny settings).
# Writes to $OUT (./gpu-check-out where unset): summary.txt, setup.log, bench.log,
# tests.log, train_1b_fp32.json, train_1b_bf16.json, train_67m.json.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/gpu-check-out}
T0=$(date +%s)
CPU=${STEP_CHECK_ALLOW_CPU:-0}
BUDGET=${STEP_CHECK_TOTAL_S:-$([ "$CPU" = 1 ] && echo 1500 || echo 575)}
PARTS=" ${STEP_CHECK_PARTS:-setup 1b_fp32 1b_bf16 67m tests} "
WORK=/tmp/step-check
PY=$(command -v python3 || command -v python)
for w in $PARTS; do
  case $w in setup|project|1b_fp32|1b_bf16|67m|tests) ;;
    *) echo "step-check: refused: STEP_CHECK_PARTS has '$w' (setup, project, 1b_fp32, 1b_bf16, 67m, tests)" >&2; exit 2 ;;
  esac
done
want() { [[ $PARTS == *" $1 "* ]]; }
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT_DIR" || exit 2
export PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { echo "step-check: $*" | tee -a "$WORK/summary" >&2; }

if [ "$CPU" = 1 ]; then
  export GPU_CHECK_ALLOW_CPU=1
  DEV=(--device cpu) ONE_B=(--quick --batch 2 --seq 32 --warmup 1 --steps 2) SMALL=(--quick)
else
  DEV=(--device cuda) ONE_B=(--model 1b --batch 8 --seq 1024 --warmup 1 --steps 3) SMALL=(--steps 6)
fi

if want setup; then
  GPU_CHECK_STAGES=setup GPU_CHECK_TOTAL_S=$(( $(left) < 170 ? $(left) : 170 )) OUT=$WORK/setup-out \
    bash benchmarks/gpu/check.sh >"$WORK/setup.stdout" 2>&1
  note "setup exit $? after $(( $(date +%s) - T0 )) s"
  cat "$WORK/setup-out/summary.txt" "$WORK/setup-out/setup.log" >"$OUT_DIR/setup.log" 2>/dev/null
fi
if want project; then
  { "$PY" -m pip install -q --no-index --no-deps --find-links .gpu-check/wheels libaio==0.9.5 &&
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . &&
    "$PY" -c "import offload._C"; } >"$OUT_DIR/setup.log" 2>&1
  note "project exit $? after $(( $(date +%s) - T0 )) s"
fi
# What check.sh's benches run under: libaio from the carried .debs (DeepSpeed's
# async_io: its compatibility test compiles against it at run time too, and
# py-libaio), and the arch list DeepSpeed's ops were built with.
AIO=/tmp/gpu-check/libaio
AIO_LIB=$(dirname "$(find "$AIO" -name 'libaio.so*' 2>/dev/null | head -n 1)" 2>/dev/null)
if [ -n "$AIO_LIB" ] && [ "$AIO_LIB" != . ]; then
  export LD_LIBRARY_PATH="$AIO_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CFLAGS="-I$AIO/usr/include" LDFLAGS="-L$AIO_LIB" CPATH="$AIO/usr/include" LIBRARY_PATH="$AIO_LIB"
fi
if [ "$CPU" = 1 ]; then export TORCH_EXTENSIONS_DIR=/tmp/gpu-check-torch-extensions; else export TORCH_CUDA_ARCH_LIST=9.0; fi
HAVE_DS=$("$PY" -c "import deepspeed" >/dev/null 2>&1 && echo 1 || echo 0)
ds() { if [ "$HAVE_DS" = 1 ]; then echo "$1"; else echo "$1" | tr ',' '\n' | grep -v '^deepspeed' | paste -sd,; fi; }

bench() {  # NAME KEEP ARGS...: benchmarks/train.py within what the budget leaves after KEEP s
  local name=$1 keep=$2 limit
  shift 2
  limit=$(( $(left) - keep ))
  if [ "$limit" -lt 40 ]; then note "$name skipped ($(left) s left)"; return 1; fi
  local t=$(date +%s)
  timeout -k 5 "$limit" "$PY" benchmarks/train.py "${DEV[@]}" --deadline $((limit - 5)) "$@" \
    --out "$WORK/$name" >"$WORK/$name.json" 2>"$WORK/$name.err"
  note "$name exit $? after $(( $(date +%s) - t )) s"
  { echo "===== $name (last 80 lines)"; tail -n 80 "$WORK/$name.err"; } >>"$OUT_DIR/bench.log"
}

one_b() {  # PRECISION KEEP CONTENDERS: the 1B contenders, then offload-auto with a 24 GB card's budget
  local p=$1 keep=$2 json=$WORK/1b_$1/train.json with24=0
  case " ${STEP_CHECK_24GB:-fp32 bf16} " in *" $p "*|" 1 ") with24=1 ;; esac
  bench "1b_$p" $((keep + 45 * with24)) "${ONE_B[@]}" --precision "$p" --timeout 150 --contenders "$(ds "$3")"
  [ -f "$json" ] && cp "$json" "$OUT_DIR/train_1b_$p.json"
  [ "$with24" = 0 ] && return
  bench "1b_${p}_24gb" "$keep" "${ONE_B[@]}" --precision "$p" --timeout 120 --contenders offload-auto \
    --device-budget 24GB || return
  # offload-auto-24GB joins the first run's JSON (the same machine, minutes apart)
  "$PY" - "$json" "$WORK/1b_${p}_24gb/train.json" <<'EOF' && cp "$json" "$OUT_DIR/train_1b_$p.json"
import json, os, sys
first, second = sys.argv[1:]
r = json.load(open(first)) if os.path.exists(first) else {"results": {}}
r["results"]["offload-auto-24GB"] = json.load(open(second))["results"]["offload-auto"]
json.dump(r, open(first, "w"), indent=1)
EOF
}

# The parts run in the order STEP_CHECK_PARTS names them; each keeps back what the
# parts after it need at least: 1B fp32 ~130 s, 1B bf16 ~110 s, 67M ~100 s, the tests ~45 s.
least() { case $1 in 1b_fp32) echo 130 ;; 1b_bf16) echo 110 ;; 67m) echo 100 ;; tests) echo 45 ;; *) echo 0 ;; esac; }
after() {  # PART: the seconds kept back for the parts after it
  local seen=0 sum=0 w
  for w in $PARTS; do
    [ "$seen" = 1 ] && sum=$((sum + $(least "$w")))
    [ "$w" = "$1" ] && seen=1
  done
  echo "$sum"
}
for part in $PARTS; do
  case $part in
    1b_fp32) one_b fp32 "$(after 1b_fp32)" "${STEP_CHECK_1B_FP32:-torch,offload-cpu,offload-auto,deepspeed-cpu}" ;;
    1b_bf16) one_b bf16 "$(after 1b_bf16)" "${STEP_CHECK_1B_BF16:-torch,offload-cpu,offload-auto}" ;;
    67m)
      bench 67m "$(after 67m)" "${SMALL[@]}" --timeout 80 \
        --contenders "$(ds torch,offload-cpu,offload-nvme,deepspeed-cpu,deepspeed-nvme)"
      [ -f "$WORK/67m/train.json" ] && cp "$WORK/67m/train.json" "$OUT_DIR/train_67m.json" ;;
    tests)
      if [ "$(left)" -ge 30 ]; then
        GPU_CHECK_STAGES=cuda_tests GPU_CHECK_TOTAL_S=$(left) GPU_CHECK_TESTS_CAP=$(left) \
          GPU_CHECK_WORK=/tmp/gpu-check-tests OUT=$WORK/tests-out bash benchmarks/gpu/check.sh \
          >"$WORK/tests.stdout" 2>&1
        note "tests exit $? after $(( $(date +%s) - T0 )) s in all"
        cat "$WORK/tests-out/summary.txt" "$WORK/tests-out/tests.log" >"$OUT_DIR/tests.log" 2>/dev/null
      fi ;;
  esac
done

# The summary: each contender's median step, peak memory, bus bytes and seconds a step.
"$PY" - "$OUT_DIR" >>"$WORK/summary" 2>&1 <<'EOF'
import json, os, statistics, sys
out = sys.argv[1]
for f in ("train_1b_fp32.json", "train_1b_bf16.json", "train_67m.json"):
    path = os.path.join(out, f)
    if not os.path.exists(path):
        continue
    r = json.load(open(path))
    print(f"== {f}: {r.get('params', 0) / 1e9:.3f}B params")
    for name, v in r["results"].items():
        if "median_s" not in v:
            print(f"  {name:<18} {'skipped' if v.get('skipped') else 'FAILED'}: {str(v.get('error') or v.get('reason'))[:160]}")
            continue
        line = f"  {name:<18} {v['median_s']:.3f} s  GPU {v.get('peak_gpu_bytes', 0) / 2**30:.1f} GiB  RSS {v['peak_rss_bytes'] / 2**30:.1f} GiB"
        steps = v.get("timeline_per_step") or []
        if steps:
            cp = v["critical_path_median"]
            bus = [s.get("bus", {}) for s in steps]
            med = lambda k: statistics.median(b.get(k, 0) for b in bus)
            line += (f"  compute {cp['compute_s']:.3f} wait {cp['wait_s']:.3f} opt {cp['optimizer_s']:.3f}"
                     f" adam {statistics.median(s['optimizer_gparams_per_s'] for s in steps):.2f} G/s"
                     f"  up {med('up_bytes') / 1e9:.2f} GB {med('up_s'):.3f} s down {med('down_bytes') / 1e9:.2f} GB"
                     f" {med('down_s'):.3f} s  rate {v.get('bus_rate_gbps')}")
        print(line + f"  losses {[round(x, 4) for x in v.get('losses', [])][:4]}")
EOF
{ echo "== step-check $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>&1 | tail -n 1)"
  cat "$WORK/summary"; } >"$OUT_DIR/summary.txt"
cat "$OUT_DIR/summary.txt"
