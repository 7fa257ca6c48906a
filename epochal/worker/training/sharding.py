"""Deterministic sharding of a map-style dataset across ranks, equal batch counts by construction.

:class:`ShardSampler` is a batch sampler. Each epoch it draws one permutation of the whole
dataset from ``seed + epoch`` (the same on every rank, no communication), deals it out to the
ranks round-robin — so the shards are disjoint and their union is exactly the dataset — and cuts
every rank's shard into the same number of batches.

The remainder, written out: with ``n`` samples, ``w`` ranks and batch size ``b``, every rank runs
``ceil(n / (w*b))`` batches (as many as the global batches of ``w*b`` it takes to cover the data).
Rank shards differ by at most one sample, and each rank's batches differ in size by at most one,
none larger than ``b``. So nothing is dropped and nothing is repeated; when ``n`` is not a
multiple of ``w*b``, some batches are smaller than ``b``. (PyTorch's DistributedSampler instead
pads with repeated samples, or drops them with ``drop_last``.) DDP averages gradients per rank,
so a sample in a smaller batch weighs slightly more in that step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch

from epochal.errors import ConfigError


def _size(data: int | Sized) -> int:
    return data if isinstance(data, int) else len(data)


class ShardSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's batches of dataset indices; call ``set_epoch`` before each epoch."""

    def __init__(
        self,
        data: int | Sized,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        n = _size(data)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}")
        if batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {batch_size}")
        batches = -(-n // (world_size * batch_size))
        if n // world_size < max(1, batches):
            raise ConfigError(
                f"{n} samples cannot give {world_size} ranks {max(1, batches)} non-empty batches "
                f"each: use a batch size of at least 2, fewer ranks, or more data"
            )
        self.n = n
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.batches = batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (the coordinator's epoch number) from now on."""
        self.epoch = epoch

    def shard(self) -> list[int]:
        """This rank's indices for the current epoch, in order."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        shard = self.shard()
        base, extra = divmod(len(shard), self.batches)
        start = 0
        for i in range(self.batches):
            size = base + (1 if i < extra else 0)
            yield shard[start : start + size]
            start += size

    def __len__(self) -> int:
        return self.batches
