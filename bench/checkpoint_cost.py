"""What a checkpoint costs relative to an epoch, on the digits example.

Runs ``examples/digits.py`` on 2 workers with a checkpoint every epoch and with none, alternating,
and compares the median time between consecutive epoch decisions (the coordinator's journal
stamps each one): with checkpoints that interval holds one epoch plus one checkpoint.

    python bench/checkpoint_cost.py [--epochs 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launchers import epochal_run_command, launch_env

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.py"


def intervals(run_dir: Path) -> list[float]:
    lines = (run_dir / "epochs.jsonl").read_text().splitlines()
    times = [r["time"] for r in map(json.loads, lines) if r["kind"] == "epoch"]
    return [b - a for a, b in itertools.pairwise(times[1:])]  # skip the warm-up epoch


def run(epochs: int, every: int, run_dir: Path) -> list[float]:
    subprocess.run(
        epochal_run_command(2, epochs, run_dir, "--checkpoint-every", str(every), str(EXAMPLE)),
        check=True,
        env=launch_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return intervals(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with_ckpt: list[float] = []
    without: list[float] = []
    with tempfile.TemporaryDirectory(prefix="epochal-ckpt-") as tmp:
        for i in range(args.repeats):
            for every, sink in ((1, with_ckpt), (0, without)):
                sink += run(args.epochs, every, Path(tmp) / f"r{i}-{every}")
    epoch = statistics.median(without)
    total = statistics.median(with_ckpt)
    print(f"median epoch without checkpoints: {epoch * 1000:.1f} ms")
    print(f"median epoch with a checkpoint:   {total * 1000:.1f} ms")
    cost = total - epoch
    print(f"checkpoint cost: {cost * 1000:.1f} ms = {cost / epoch:.2f} epochs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
