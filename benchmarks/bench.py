"""DP vs non-private vs PyTorch/Opacus throughput and DP-step memory; same as `dpbert bench`.

Usage: python benchmarks/bench.py [--model tiny|mini|base] [--batch B] [--microbatch M] [--json]
"""

import sys

from dpbert.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
