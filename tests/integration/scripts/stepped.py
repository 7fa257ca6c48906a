"""A worker script for epochs of N steps: a tiny regression whose loss function writes the
sample ids of each training batch, one line a batch (``world rank epoch generation id id ...``),
to a file of its own process, and the learning rate after each optimizer step to another
(``world rank lr``). The epoch and the world's generation come from the trainer's per-step fault
hook, the one place they are passed per step: an elastic test keeps the last try of each epoch by
them.

``--style sampler`` reads a loader of the script's own, per rank, with a DistributedSampler
(4 samples a rank); ``--style passes`` reads ``epochal.batches`` with a global batch of 12
(``--global-batch``); ``--style stream`` reads an endless stream per rank through a loader of
the script's own that counts the batches it yielded, its ``state_dict()``.
``--scheduler onecycle`` steps a ``OneCycleLR`` (rate and momentum) after every optimizer step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import epochal
from epochal.worker import faults


class Lookup(nn.Module):
    """A linear model of the features of the sample ids it is given."""

    def __init__(self, features: torch.Tensor) -> None:
        super().__init__()
        self.features = features
        self.linear = nn.Linear(features.shape[1], 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(self.features[ids]).squeeze(1)


class Stream(IterableDataset):
    """Rank ``rank``'s endless share of ``samples`` ids: ``rank``, ``rank + world``, ..."""

    def __init__(self, rank: int, world: int, samples: int) -> None:
        self.rank, self.world, self.samples = rank, world, samples

    def __iter__(self) -> Iterator[int]:
        return ((self.rank + self.world * k) % self.samples for k in itertools.count())


class CountingLoader:
    """Batches of 4 of a stream that can say where it stands: the batches it yielded."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.yielded = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        ids = itertools.islice(iter(self.stream), 4 * self.yielded, None)
        while True:
            batch = torch.tensor(list(itertools.islice(ids, 4)))
            self.yielded += 1
            yield batch, batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.yielded = state["yielded"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--style", choices=("sampler", "passes", "stream"), default="sampler")
    parser.add_argument("--scheduler", choices=("none", "onecycle"), default="none")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=12, help="with --style passes")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds per batch")
    parser.add_argument(
        "--slow-below", type=int, default=0, help="batches take --step-delay below N workers"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.samples, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(args.samples)
    ids = torch.arange(args.samples)
    data = TensorDataset(ids, ids)  # (inputs, targets): both the sample's id
    model = Lookup(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / f"ids-{os.getpid()}.txt").open("a", buffering=1)
    step = {"epoch": -1, "world": -1}
    hit = faults.hit

    def tagged(point: str, **at: int) -> None:
        if point == "train-step":
            step.update(epoch=at["epoch"], world=at["world"])
        hit(point, **at)

    faults.hit = tagged
    rates = (args.out / f"lr-{os.getpid()}.txt").open("a", buffering=1)

    def stepped_rate(opt: torch.optim.Optimizer, *_: object) -> None:
        where = f"{dist.get_world_size()} {dist.get_rank()} "
        rates.write(where + repr(opt.param_groups[0]["lr"]) + "\n")

    optimizer.register_step_post_hook(stepped_rate)

    def sampler_loader(rank: int, world: int) -> DataLoader:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=7)
        return DataLoader(data, batch_size=4, sampler=sampler)

    def loss_fn(out: torch.Tensor, batch_ids: torch.Tensor) -> torch.Tensor:
        if model.training:
            world = dist.get_world_size()
            if world < args.slow_below:
                time.sleep(args.step_delay)
            where = f"{world} {dist.get_rank()} {step['epoch']} {step['world']} "
            log.write(where + " ".join(map(str, batch_ids.tolist())) + "\n")
        return nn.functional.mse_loss(out, y[batch_ids])

    loader = sampler_loader
    if args.style == "passes":
        loader = epochal.batches(data, global_batch=args.global_batch, seed=7)
    elif args.style == "stream":
        loader = lambda rank, world: CountingLoader(Stream(rank, world, args.samples))  # noqa: E731
    scheduler = None
    if args.scheduler == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=40)
    result = epochal.train(model, optimizer, loader, None, loss_fn, scheduler=scheduler)
    torch.save(
        {"model": model.state_dict(), "epochs": [r.epoch for r in result.curve]},
        args.out / f"rank{result.rank}.pt",
    )


if __name__ == "__main__":
    main()
