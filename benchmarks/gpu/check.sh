#!/usr/bin/env bash
# The GPU check in one command (benchmarks/gpu/README.md; the code: gpucheck/check.py).
py=$(command -v python3 || command -v python) || { echo "gpu-check: refused: no python3 or python on PATH" >&2; exit 2; }
exec "$py" "$(dirname "$0")/gpucheck" check
