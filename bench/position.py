"""What a resume to the middle of a pass costs: jumping there against reading up to it.

A map-style dataset of ``--samples`` (1,000,000) samples whose ``__getitem__`` builds a small
tensor, in batches of ``--batch`` (256) on one rank. Three ways to the first batch after the
middle of a pass, each timed from nothing built to that batch in hand:

- ``PassSampler``: set its position to the middle and take the first batch of a ``DataLoader``
  over it (one permutation of the samples and a slice);
- ``skip_consumed``: the same loader built the plain way (a ``DistributedSampler``), its
  consumed batches' indices drawn and dropped;
- iterating: the plain loader read batch by batch up to the middle, as a loader that cannot
  jump resumes.

Prints each time and the ratios to iterating (target for ``PassSampler``: <= 1 %).

    python bench/position.py [--samples 1000000] [--batch 256] [--repeats 5] [--workers 0]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from epochal.position import DataPosition, batches_per_pass
from epochal.worker.training.passes import PassSampler
from epochal.worker.training.positioning import skip_consumed

SEED = 3


class Built(Dataset[torch.Tensor]):
    """Sample ``i``: a 16-float tensor built from ``i``, the small real cost of a load."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((16,), float(index)) * 0.5 + 1.0


def plain_loader(data: Built, batch: int, workers: int) -> DataLoader[torch.Tensor]:
    sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=SEED)  # type: ignore[arg-type]
    return DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)


def jump(data: Built, batch: int, middle: int, workers: int) -> torch.Tensor:
    sampler = PassSampler(data, global_batch=batch, rank=0, world=1, seed=SEED)
    sampler.set_position(DataPosition(0, middle, SEED))
    return next(iter(DataLoader(data, batch_sampler=sampler, num_workers=workers)))


def skip(data: Built, batch: int, middle: int, workers: int) -> torch.Tensor:
    return next(iter(skip_consumed(plain_loader(data, batch, workers), 0, middle)))


def iterate(data: Built, batch: int, middle: int, workers: int) -> torch.Tensor:
    loader = plain_loader(data, batch, workers)
    loader.sampler.set_epoch(0)  # type: ignore[attr-defined]
    return next(itertools.islice(iter(loader), middle, None))


def timed(way: Callable[..., torch.Tensor], *args: int | Built) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    first = way(*args)
    return time.perf_counter() - start, first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="of each jump (iterating: once)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Built(args.samples)
    middle = batches_per_pass(args.samples, args.batch) // 2
    print(f"{args.samples:,} samples, batches of {args.batch}: to batch {middle:,} of the pass")
    ways = {"PassSampler": jump, "skip_consumed": skip}
    times: dict[str, list[float]] = {name: [] for name in ways}
    firsts = {}
    for _ in range(args.repeats):
        for name, way in ways.items():
            took, firsts[name] = timed(way, data, args.batch, middle, args.workers)
            times[name].append(took)
    baseline, firsts["iterating"] = timed(iterate, data, args.batch, middle, args.workers)
    # all three must reach the same batch, or the comparison measures nothing
    same = all(torch.equal(first, firsts["iterating"]) for first in firsts.values())
    print(f"{'way':<16}{'time':>12}{'/ iterating':>14}")
    for name, samples in times.items():
        took = statistics.median(samples)
        print(f"{name:<16}{took * 1000:>9.1f} ms{took / baseline:>13.2%}")
    print(f"{'iterating':<16}{baseline * 1000:>9.1f} ms{1:>13.2%}")
    print(f"the same first batch each way: {same}")
    ratio = statistics.median(times["PassSampler"]) / baseline
    verdict = "PASS" if ratio <= 0.01 else "MISS"
    print(f"PassSampler / iterating: {ratio:.2%} (target <= 1%): {verdict}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
