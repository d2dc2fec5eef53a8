#!/usr/bin/env bash
# The offloaded step on a GPU, measured in one call (benchmarks/gpu/README.md; the code: gpucheck/step.py).
py=$(command -v python3 || command -v python) || { echo "step-check: refused: no python3 or python on PATH" >&2; exit 2; }
exec "$py" "$(dirname "$0")/gpucheck" step
