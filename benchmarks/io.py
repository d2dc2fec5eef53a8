"""NVMe path benchmark; same as `offload bench io` (see benchmarks/offload_bench/io.py).

    python benchmarks/io.py --path /nvme/dir [--quick]
"""
import argparse
import sys

from offload_bench import io

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=io.__doc__.split("\n\n")[0])
    io.add_arguments(parser)
    sys.exit(io.run(parser.parse_args()))
