"""The `offload` command (also `python -m offload`).

  offload report            versions, native extension, SIMD, threads, I/O backends
  offload estimate ...      memory per tier for a model size and a config (offload/sizing/)
  offload consolidate ...   one safetensors file from a checkpoint (offload/checkpoint_io/consolidation.py)
  offload bench adam ...    CPU Adam benchmark (benchmarks/offload_bench/cpu_adam.py)
  offload bench adam-reference ...  the host update against torch's AdamW (adam_reference.py)
  offload bench compile ... engine.compile() against plain torch compiled the same way (compile_blocks.py)
  offload bench io ...      NVMe path benchmark (benchmarks/offload_bench/io.py)
  offload bench train ...   whole training steps (benchmarks/offload_bench/train.py)
  offload bench soak ...    a long NVMe run with checkpoints stays flat (benchmarks/offload_bench/soak.py)

The benchmarks live in the offload_bench package (benchmarks/offload_bench/,
installed beside offload); each module owns its arguments: it exposes
add_arguments(parser) and run(args) -> int.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
BENCHMARKS = {
    "adam": ("offload_bench.cpu_adam", "CPU Adam: ours vs torch and DeepSpeed, fp32 and offload cases"),
    "adam-reference": ("offload_bench.adam_reference", "the host update against torch's AdamW on a device, "
                                                       "element by element"),
    "compile": ("offload_bench.compile_blocks", "engine.compile() against plain torch compiled the same way: "
                                                "graph breaks, losses"),
    "io": ("offload_bench.io", "NVMe path: our async I/O backends vs fio and DeepSpeed aio"),
    "train": ("offload_bench.train", "training steps: offload vs DeepSpeed ZeRO-3 vs plain torch"),
    "soak": ("offload_bench.soak", "a long NVMe run with checkpoints: RSS, fds, threads and disk stay flat"),
}


def build_parser() -> argparse.ArgumentParser:
    from offload import __version__

    parser = argparse.ArgumentParser(prog="offload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"offload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="print the environment and what offload will use")
    report.add_argument("--json", action="store_true", help="print JSON instead of text")
    from offload.sizing import cli as sizing

    sizing.add_arguments(sub.add_parser(
        "estimate", help="bytes per tier (device, host, NVMe) for a model and a configuration"))
    importlib.import_module("offload.checkpoint_io.consolidation").add_arguments(sub.add_parser(
        "consolidate", help="write a checkpoint's full model as one safetensors file"))
    bench = sub.add_parser("bench", help="run a benchmark (JSON on stdout; JSON and PNG under --out, "
                                         "default bench_out/)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text)
        p.set_defaults(bench_module=module_name)
        try:
            importlib.import_module(module_name).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name not in (module_name, "offload_bench"):
                raise  # a dependency of the benchmark: main() names it
            p.set_defaults(bench_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as exc:
        # A runtime dependency missing from this Python: say which and how to
        # install it, as `offload report` does, instead of a traceback.
        from offload import report
        from offload.requirements import RUNTIME

        missing = [r for r in RUNTIME if r.module == (exc.name or "").split(".")[0]]
        if not missing:
            raise
        print(report.explain_missing(missing), file=sys.stderr)
        return 1


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from offload import report

        return report.main(as_json=args.json)
    if args.command == "estimate":
        from offload.sizing import cli as sizing

        return sizing.run(args)
    if args.command == "consolidate":
        return importlib.import_module("offload.checkpoint_io.consolidation").run(args)
    if getattr(args, "bench_missing", False):
        print(f"offload bench {args.benchmark}: {args.bench_module} is not installed beside offload "
              "(it ships in the same distribution: reinstall with `pip install -e .` from a checkout)",
              file=sys.stderr)
        return 2
    return importlib.import_module(args.bench_module).run(args)


if __name__ == "__main__":
    sys.exit(main())
