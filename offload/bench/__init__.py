"""Benchmarks run by `offload bench NAME` (also thin scripts under benchmarks/).

Each module exposes add_arguments(parser) and run(args) -> int, prints JSON to
stdout and writes a PNG; helpers shared by all of them live in _common.py.
"""
