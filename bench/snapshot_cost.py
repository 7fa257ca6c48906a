"""What the per-epoch snapshot of an elastic run costs: time and host memory of ``Snapshot.take``.

    python bench/snapshot_cost.py             # the digits example's model and a 25M-parameter one
    python bench/snapshot_cost.py --repeats 9

For each model, in one process (a one-rank gloo group, mode replicated, the model on the CPU): the
optimizer is given its state by one training step, then ``Snapshot.take`` runs ``--repeats``
times. It prints the median time of a take, the bytes the snapshot holds, the growth of the
process's resident memory while one snapshot is held, the median time of a restore, and, as the
baseline measured in the same run, the median time of one training step (forward, backward,
optimizer step) on a batch of ``--batch`` samples: a take costs about that many steps once per
epoch. A benchmark, not a test: nothing here is collected by pytest.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from epochal.worker.regroup import Snapshot
from epochal.worker.strategies import Strategy, wrap


def digits() -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """examples/digits.py's model and optimizer (64 inputs)."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 64


def wide() -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """Six 2048x2048 layers: 25.2M parameters, AdamW (two state tensors per parameter)."""
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), 2048


def resident() -> int:
    """This process's resident memory, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    name: str,
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, int]],
    repeats: int,
    batch: int,
) -> None:
    torch.manual_seed(0)
    model, optimizer, width = build()
    strategy: Strategy = wrap(model, optimizer, torch.device("cpu"), mode="replicated")
    x, y = torch.randn(batch, width), torch.randn(batch, 10 if width == 64 else width)

    def step() -> None:
        strategy.begin_epoch()
        strategy.zero_grad()
        out = strategy.module(x)
        nn.functional.mse_loss(out[:, : y.shape[1]], y).backward()  # type: ignore[no-untyped-call]
        strategy.step()

    step()  # the optimizer has its state, as at any epoch start after the first
    step_s = median(step, repeats)
    params = sum(p.numel() for p in model.parameters())
    gc.collect()
    before = resident()
    held = Snapshot.take(strategy)
    grown = resident() - before
    take_s = median(lambda: Snapshot.take(strategy), repeats)
    restore_s = median(lambda: held.restore(strategy), repeats)
    print(
        f"{name}: {params / 1e6:.2f}M parameters, {type(optimizer).__name__}; snapshot "
        f"{held.nbytes / 2**20:.1f} MiB (resident +{grown / 2**20:.1f} MiB); take "
        f"{take_s * 1e3:.2f} ms, restore {restore_s * 1e3:.2f} ms; one training step "
        f"(batch {batch}) {step_s * 1e3:.2f} ms: a take costs {take_s / step_s:.2f} steps",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(str(Path(tmp) / "store"), 1),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
        )
        try:
            measure("digits", digits, args.repeats, args.batch)
            measure("25M", wide, args.repeats, args.batch)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
