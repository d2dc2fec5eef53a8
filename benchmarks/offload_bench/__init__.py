"""The benchmarks behind `offload bench NAME`, and the workload they share with
the examples: a plain GPT (gpt.py) and a byte-level corpus of Python's own
standard library sources (corpus.py), on every machine without a download.

Installed beside the engine, not inside it: `pip install offload` gives both
packages, so `offload bench` works without a checkout, while `import offload`
never loads any of this. Each benchmark module exposes add_arguments(parser)
and run(args) -> int, prints JSON to stdout and writes a PNG; helpers shared by
all of them live in common.py. benchmarks/*.py are thin scripts over them.
"""
