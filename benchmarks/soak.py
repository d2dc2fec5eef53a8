"""Soak: 1,000 NVMe steps with a checkpoint every 100 keep RSS, fds, threads and disk flat;
same as `offload bench soak` (see benchmarks/offload_bench/soak.py).

    python benchmarks/soak.py [--out DIR] [--steps 1000 --checkpoint-every 100] [--nvme-dir DIR]
"""
import argparse
import sys

from offload_bench import soak

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=soak.__doc__.split("\n\n")[0])
    soak.add_arguments(parser)
    sys.exit(soak.run(parser.parse_args()))
