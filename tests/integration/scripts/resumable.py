"""A worker script whose result depends on every random generator: for the resume tests.

Shuffled per-rank loaders (DistributedSampler seeded per epoch and a RandomSampler drawing from
torch's global generator), dropout, momentum, a step learning-rate schedule from the coordinator.
``--delay`` slows each step so a test can kill the run mid-epoch. ``--best-at E`` adds a penalty to
the validation loss of every epoch but E (counted in this process), so E becomes the best epoch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import resumable_workload
import torch
from resumable_workload import workload
from torch import nn
from torch.utils.data import DataLoader

import epochal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--best-at", type=int, default=None)
    parser.add_argument("--accuracy", action="store_true", help="report an accuracy metric")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y, model, optimizer = workload()

    def train_loader(rank: int, world: int) -> DataLoader:
        return resumable_workload.train_loader(x, y, rank, world)

    def valid_loader(rank: int, world: int) -> DataLoader:
        return resumable_workload.valid_loader(x, y, rank, world)

    valid_batches = 0

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal valid_batches
        if args.delay:
            time.sleep(args.delay)
        loss = nn.functional.cross_entropy(out, target)
        if args.best_at is not None and not model.training:
            epoch = valid_batches // 2  # two validation batches per epoch
            valid_batches += 1
            loss = loss + 10.0 * abs(epoch - args.best_at)
        return loss

    def accuracy(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        return (out.argmax(dim=1) == target).sum(), len(target)

    join_options: dict = {"metrics": {"accuracy": accuracy}} if args.accuracy else {}
    result = epochal.train(model, optimizer, train_loader, valid_loader, loss_fn, **join_options)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "best_epoch": result.best_epoch,
            "best": None if result.best is None else result.best.epoch,
            "weights_note": result.weights_note,
            "curve": [
                (r.epoch, r.train_loss, r.valid_loss, r.smoothed_loss, r.metrics)
                for r in result.curve
            ],
        },
        args.out / f"rank{result.rank}.pt",
    )
    print(f"rank {result.rank} finished: best epoch {result.best_epoch}", flush=True)


if __name__ == "__main__":
    main()
