"""A script written for torchrun: reads RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE, trains
with epochal, then keeps working after ``epochal.train()`` returns (``--after S`` seconds), as a
script that evaluates, saves or exports does."""

from __future__ import annotations

import argparse
import os
import sys
import time

from linear import main as train_linear  # the tests' reproducible workload, next to this file

parser = argparse.ArgumentParser()
parser.add_argument("--after", type=float, default=0.0)
args, rest = parser.parse_known_args()
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
print("torchrun variables: " + " ".join(f"{n}={os.environ.get(n)}" for n in names), flush=True)
sys.argv[1:] = rest
train_linear()
time.sleep(args.after)
print(f"rank {os.environ['RANK']}: post-training work done", flush=True)
