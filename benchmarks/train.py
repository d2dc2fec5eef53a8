"""Training step benchmark; same as `offload bench train` (see benchmarks/offload_bench/train.py).

    python benchmarks/train.py [--out DIR] [--nvme-dir DIR] [--quick] [--device cpu|cuda|sim]

    python benchmarks/train.py --device cuda    # the GPU readiness run: torch, ours (cpu, nvme),
                                                # FSDP2 with CPU offload, DeepSpeed ZeRO-3 offload
    python benchmarks/train.py --device sim --contenders offload-nvme --sim-gbps 25
                                                # how much transfer time was hidden behind compute
"""
import argparse
import sys

from offload_bench import train

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=train.__doc__.split("\n\n")[0])
    train.add_arguments(parser)
    sys.exit(train.run(parser.parse_args()))
