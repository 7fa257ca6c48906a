"""A tiny, exactly reproducible worker script for the multi-process tests.

Linear regression on fixed synthetic data. Global batch ``GLOBAL_BATCH`` rows; rank r of w takes
rows ``[i*B + r*B/w, i*B + (r+1)*B/w)`` of global batch i, so w workers averaging gradients (DDP)
take exactly the steps one process takes on the union. ``--mode`` breaks one rank on purpose.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import epochal

GLOBAL_BATCH = 12
N_TRAIN = 48
N_VALID = 24
FEATURES = 5
LR = 0.05
MOMENTUM = 0.5


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(FEATURES, 1, generator=g)
    x = torch.randn(N_TRAIN + N_VALID, FEATURES, generator=g)
    y = x @ w + 0.3 * torch.randn(N_TRAIN + N_VALID, 1, generator=g)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def make_model(out_features: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, out_features)


def shard(x: torch.Tensor, y: torch.Tensor, batch: int, rank: int, world: int) -> list:
    per = batch // world
    return [
        (x[i + rank * per : i + (rank + 1) * per], y[i + rank * per : i + (rank + 1) * per])
        for i in range(0, len(x), batch)
    ]


def uneven_shard(x: torch.Tensor, y: torch.Tensor, batch: int, rank: int, world: int) -> list:
    """Like :func:`shard`, but rank r takes a share of each batch that grows with r (1, 2, ...
    parts of ``world * (world + 1) / 2``): every rank has the same number of batches and a
    different number of samples."""
    parts = world * (world + 1) // 2
    start = batch * (rank * (rank + 1) // 2) // parts
    end = batch * ((rank + 1) * (rank + 2) // 2) // parts
    return [(x[i + start : i + end], y[i + start : i + end]) for i in range(0, len(x), batch)]


def close(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Samples predicted within 0.5 of their target, and how many samples there were."""
    return ((out - target).abs() < 0.5).sum(), len(target)


class SlowLoader:
    """Batches that each take ``delay`` seconds to load (a slow disk): epochs long enough for
    another process to start meanwhile."""

    def __init__(self, batches: list, delay: float) -> None:
        self.batches, self.delay = batches, delay

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            time.sleep(self.delay)
            yield batch


class HangingLoader:
    """A validation loader whose iterator never yields (a stuck file system, say)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        time.sleep(3600)
        yield from self.batches


def gloo_threads() -> list[str]:
    """This process's gloo threads, by name: none once the run's process groups closed."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode",
        default="train",
        choices=["train", "uneven", "empty", "mismatch", "raise", "no-valid", "hang-valid"],
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds per batch")
    parser.add_argument(
        "--slow-below",
        type=int,
        default=None,
        metavar="N",
        help="batches take --step-delay only in a world of fewer than N workers",
    )
    parser.add_argument(
        "--parallel",
        default="replicated",
        choices=["replicated", "main", "sharded", "fully_sharded"],
        help="fit's mode",
    )
    parser.add_argument(
        "--no-snapshot", action="store_true", help="elastic runs restore the last checkpoint"
    )
    parser.add_argument("--precision", default="32")
    parser.add_argument("--clip-grad-norm", type=float, default=None)
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="report the 'close' metric, over validation shards of uneven sizes",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    my_rank = int(os.environ.get("EPOCHAL_RANK", "0"))
    broken = my_rank == 1

    x, y, xv, yv = data()
    model = make_model(2 if args.mode == "mismatch" and broken else 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def train_loader(rank: int, world: int) -> list:
        batches = shard(x, y, GLOBAL_BATCH, rank, world)
        if broken and args.mode == "uneven":
            return batches[:-1]
        if broken and args.mode == "empty":
            return []
        slow = args.step_delay and (args.slow_below is None or world < args.slow_below)
        return SlowLoader(batches, args.step_delay) if slow else batches

    def valid_loader(rank: int, world: int) -> Any:
        split = uneven_shard if args.metrics else shard
        batches = split(xv, yv, GLOBAL_BATCH, rank, world)
        return HangingLoader(batches) if broken and args.mode == "hang-valid" else batches

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if broken and args.mode == "raise":
            raise ValueError("boom: a deliberate failure in the loss")
        return nn.functional.mse_loss(out, target)

    result = epochal.train(
        model,
        optimizer,
        train_loader,
        None if args.mode == "no-valid" else valid_loader,
        loss_fn,
        precision=args.precision,
        clip_grad_norm=args.clip_grad_norm,
        mode=args.parallel,
        snapshot=not args.no_snapshot,
        metrics={"close": close} if args.metrics else {},
    )
    print(f"rank {result.rank}: best epoch {result.best_epoch} of {result.epochs_run}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "state": model.state_dict(),
                "best_epoch": result.best_epoch,
                "valid_losses": [r.valid_loss for r in result.curve],
                "train_losses": [r.train_loss for r in result.curve],
                "pid": os.getpid(),
                "metrics": [r.metrics for r in result.curve],
                "gloo_threads": gloo_threads(),
            },
            args.out / f"rank{result.rank}.pt",
        )


if __name__ == "__main__":
    main()
