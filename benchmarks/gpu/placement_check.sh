#!/usr/bin/env bash
# Issue 25's GPU figure in one device call, after check.sh's setup: GPT 0.94B,
# batch 8 x seq 1024, offload-auto with the device budget of a 24 GB card
# against offload-cpu (all parameters on the host) and torch in GPU memory.
# Writes to $OUT: check.sh's summary.txt and setup.log, then train_1b_auto.json
# (each contender's median step, its placement: bytes per tier and per link).
#   run(command="bash benchmarks/gpu/placement_check.sh", carry=[".gpu-check"], timeout_s=300)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
OUT_DIR=${OUT:-$PWD/gpu-check-out}
T0=$(date +%s)
BUDGET=${PLACEMENT_CHECK_TOTAL_S:-280}
GPU_CHECK_STAGES="setup" GPU_CHECK_TOTAL_S=120 bash benchmarks/gpu/check.sh
left=$(( BUDGET - ($(date +%s) - T0) - 10 ))
if [ "$left" -lt 60 ]; then echo "placement-check: skipped ($left s left)"; exit 0; fi
PYTHONUNBUFFERED=1 timeout -k 5 "$left" python3 benchmarks/train.py --model 1b --device cuda --batch 8 \
  --seq 1024 --warmup 1 --steps 3 --deadline $((left - 5)) --contenders torch,offload-cpu,offload-auto \
  --device-budget 24GB --out /tmp/placement-1b >/dev/null 2>/tmp/placement-1b.err
echo "placement-check: exit $? after $(( $(date +%s) - T0 )) s"
tail -n 8 /tmp/placement-1b.err
[ -f /tmp/placement-1b/train.json ] && cp /tmp/placement-1b/train.json "$OUT_DIR/train_1b_auto.json"
exit 0
