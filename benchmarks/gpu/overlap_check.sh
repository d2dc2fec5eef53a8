#!/usr/bin/env bash
# Issue 24's GPU figures in one device call, after check.sh's setup: GPT 0.94B,
# batch 8 x seq 1024, on the lent GPU (.gpu-check/ carried, as for check.sh):
#   1. check.sh's setup and bench_1b with torch, offload-cpu, deepspeed-cpu (fp32);
#   2. torch and offload-cpu with --grad-clip 1.0 (Hugging Face Trainer's default);
#   3. torch and offload-cpu with --precision bf16.
# Writes to $OUT (8 files at most): check.sh's summary.txt, setup.log, tests.log,
# bench.log, train_1b.json, train_1b.png, then train_1b_clip.json, train_1b_bf16.json.
#   run(command="bash benchmarks/gpu/overlap_check.sh", carry=[".gpu-check"], timeout_s=330)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT_DIR=${OUT:-$PWD/gpu-check-out}
T0=$(date +%s)
BUDGET=${OVERLAP_CHECK_TOTAL_S:-310}
GPU_CHECK_STAGES="setup bench_1b" GPU_CHECK_1B_CONTENDERS=torch,offload-cpu,deepspeed-cpu \
  GPU_CHECK_TOTAL_S=${OVERLAP_CHECK_BASE_S:-190} bash benchmarks/gpu/check.sh
one() {  # NAME ARGS...: torch and offload-cpu at 0.94B with ARGS, within what the budget leaves
  local name=$1 left
  shift
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 45 ]; then echo "overlap-check: $name skipped ($left s left)"; return; fi
  [ "$left" -gt 100 ] && left=100
  PYTHONUNBUFFERED=1 timeout -k 5 "$left" python3 benchmarks/train.py --model 1b --device cuda --batch 8 \
    --seq 1024 --warmup 1 --steps 3 --deadline $((left - 5)) --contenders torch,offload-cpu "$@" \
    --out "/tmp/overlap-$name" >/dev/null 2>"/tmp/overlap-$name.err"
  echo "overlap-check: $name exit $? after $(( $(date +%s) - T0 )) s"
  tail -n 6 "/tmp/overlap-$name.err"
  [ -f "/tmp/overlap-$name/train.json" ] && cp "/tmp/overlap-$name/train.json" "$OUT_DIR/train_1b_$name.json"
}
one clip --grad-clip 1.0
one bf16 --precision bf16
exit 0
