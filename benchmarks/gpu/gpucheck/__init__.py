"""gpucheck: the GPU measurements of benchmarks/gpu/, in Python.

    python3 benchmarks/gpu/gpucheck check   # what `bash benchmarks/gpu/check.sh` runs
    python3 benchmarks/gpu/gpucheck step    # what `bash benchmarks/gpu/step_check.sh` runs

Both run on a GPU machine without network, from the standard library alone:
torch, DeepSpeed and pytest are used only in the processes they start, under
the interpreter being checked (GPU_CHECK_PYTHON, by default this one).

  check.py     gpu-check: knobs, refusals, the stages' plan and runner
  stages.py    each of check's stages, run in a process of its own
  step.py      step-check: its parts, in the order named
  budget.py    the deadline scheduler: the budget, each stage's limit, a run under it
  summary.py   check's summary table and the log files in $OUT
  probes.py    what is asked of the interpreter under test (GPU, versions, DeepSpeed's ops)
  pytest_plugin/gc_record.py   the test stages' per-test record (pytest -p gc_record)

benchmarks/gpu/README.md describes the parts, their time and the knobs.
"""
