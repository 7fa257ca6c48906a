"""The workload both benchmark scripts train: the same data, model, loaders and timing probes.

``train_ddp.py`` (plain torchrun + DDP) and ``train_epochal.py`` (``epochal run``) import this
module so that the only difference between them is who starts the workers, how they rendezvous and
who drives the epoch loop. The data is synthetic and seeded (a fixed random linear teacher labels
Gaussian inputs), so every rank and every run sees exactly the same samples.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 0


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that define the workload; ``compare.py`` passes the same ones to both scripts."""
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes its JSON")
    parser.add_argument("--samples", type=int, default=12288, help="training samples (all ranks)")
    parser.add_argument("--valid-samples", type=int, default=2048, help="validation samples")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05)


def datasets(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset]:
    """Seeded synthetic train and validation sets, identical on every rank."""
    gen = torch.Generator().manual_seed(SEED)
    total = args.samples + args.valid_samples
    x = torch.randn(total, args.features, generator=gen)
    teacher = torch.randn(args.features, args.classes, generator=gen) / math.sqrt(args.features)
    noise = 0.5 * torch.randn(total, args.classes, generator=gen)
    y = (x @ teacher + noise).argmax(dim=1)
    n = args.samples
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


def model(args: argparse.Namespace) -> nn.Module:
    """A small MLP; seed torch before building it so every rank starts from the same weights."""
    return nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.classes),
    )


def optimizer(net: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Plain SGD with momentum."""
    return torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)


@dataclass
class Timings:
    """Wall-clock instants (``time.time()``) one rank saw; rank 0's go into the JSON."""

    script_start: float
    imported: float = 0.0
    # torch (and epochal) imported
    built: float = 0.0
    # data, model and optimizer built
    joined: float = 0.0
    # process group up and this rank's loaders built (epochal: join() returned)
    first_step: float = 0.0
    # the first training batch of the first epoch handed to the training loop
    epoch_starts: list[float] = field(default_factory=list)
    # one per epoch: its training loop starting to iterate
    finished: float = 0.0
    # the training call returned (best weights restored)

    def epoch_seconds(self) -> list[float]:
        """Seconds between consecutive epoch starts: epoch k's train + validation + bookkeeping
        (and, under epochal, its report/decision and the next epoch's ready/go exchange)."""
        starts = self.epoch_starts
        return [b - a for a, b in itertools.pairwise(starts)]

    def write(self, path: Path, mode: str, world_size: int, extra: dict[str, Any]) -> None:
        """Write the timings plus ``extra`` as JSON (atomically, so a reader never sees half)."""
        record = {
            "mode": mode,
            "world_size": world_size,
            "pid": os.getpid(),
            **asdict(self),
            "epoch_seconds": self.epoch_seconds(),
            **extra,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)


class TimedLoader:
    """A DataLoader that notes when each epoch's iteration starts and when the first batch is out.

    It keeps ``len()`` and ``sampler`` (so ``set_epoch`` still reaches the DistributedSampler).
    """

    def __init__(self, loader: DataLoader[Any], timings: Timings) -> None:
        self.loader = loader
        self.sampler = loader.sampler
        self.timings = timings

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.timings.epoch_starts.append(time.time())
        for batch in self.loader:
            if not self.timings.first_step:
                self.timings.first_step = time.time()
            yield batch


def loaders(
    train_set: TensorDataset,
    valid_set: TensorDataset,
    rank: int,
    world_size: int,
    args: argparse.Namespace,
    timings: Timings,
) -> tuple[TimedLoader, DataLoader[Any]]:
    """This rank's shard of both sets, as ``examples/digits.py`` builds them."""
    train_sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED, drop_last=True
    )
    valid_sampler: DistributedSampler[Any] = DistributedSampler(
        valid_set, num_replicas=world_size, rank=rank, shuffle=False, seed=SEED, drop_last=True
    )
    train = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
    valid = DataLoader(valid_set, batch_size=args.batch_size, sampler=valid_sampler)
    timings.joined = time.time()
    return TimedLoader(train, timings), valid
