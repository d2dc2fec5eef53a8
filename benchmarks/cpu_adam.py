"""CPU Adam benchmark: ours vs torch AdamW (fused, foreach) and DeepSpeedCPUAdam.

Same as `offload bench adam`; see benchmarks/offload_bench/cpu_adam.py for what it measures.

  python benchmarks/cpu_adam.py                 # 1M,10M,50M,200M params
  python benchmarks/cpu_adam.py --quick         # smoke test
  python benchmarks/cpu_adam.py --sizes 50M --out /tmp/adam
"""
import argparse
import sys
from pathlib import Path

# Run from a checkout, benchmark that checkout (not some other installed copy).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload_bench import cpu_adam  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cpu_adam.add_arguments(parser)
    sys.exit(cpu_adam.run(parser.parse_args()))
