"""Epochs of N steps at a worker: one iterator across the epochs of a pass, the next pass
started inside an epoch, and a fresh start at any epoch (a resume) reading what an unbroken run
reads next, for epochal.batches and for a loader of the user's own with a DistributedSampler."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import epochal
from epochal.errors import ConfigError
from epochal.worker.training.feeding import Feed
from epochal.worker.training.fitting import _resolve

SAMPLES = 22  # passes of 3 global batches of 8 samples, the last one of 6


def dataset() -> TensorDataset:
    ids = torch.arange(SAMPLES)
    return TensorDataset(ids.float().unsqueeze(1), ids)


def ids(batches: Any) -> list[list[int]]:
    return [batch[1].tolist() for batch in batches]


def epochs(feed: Feed, first: int, last: int) -> list[list[int]]:
    return [ids(feed.epoch(e)) for e in range(first, last)]


def pass_loader(rank: int, world: int) -> Any:
    spec = epochal.batches(dataset(), global_batch=8, seed=3)
    return spec.loader(rank, world, endless=True)


def sampler_loader(rank: int, world: int) -> DataLoader[Any]:
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=3)
    return DataLoader(data, batch_size=4, sampler=sampler)


def test_an_epoch_of_n_batches_goes_on_through_the_passes_and_starts_the_next_inside_it():
    feed = Feed(pass_loader(0, 1), batches_per_epoch=2, world=1)
    taken = [i for epoch in epochs(feed, 0, 6) for batch in epoch for i in batch]
    passes = []
    for p in range(4):
        generator = torch.Generator().manual_seed(3 + p)
        passes += torch.randperm(SAMPLES, generator=generator).tolist()
    assert taken == passes[: len(taken)]
    assert len(taken) == 12 * 8 - 4 * 2  # 12 global batches, 4 passes' short last batches
    assert feed.shape() == (3, 8)


@pytest.mark.parametrize("make", [pass_loader, sampler_loader])
def test_a_fresh_start_at_any_epoch_reads_what_an_unbroken_run_reads_next(make):
    unbroken = epochs(Feed(make(1, 2), 2, world=2), 0, 7)
    for start in range(1, 7):
        resumed = epochs(Feed(make(1, 2), 2, world=2), start, 7)
        assert resumed == unbroken[start:], start


def test_every_sample_of_a_pass_is_trained_once_when_the_world_changes_mid_pass():
    # global batches of 12: 2 and 3 workers both divide them; epochs of 1 batch, passes of 2
    spec = epochal.batches(torch.arange(24), global_batch=12, shuffle=True, seed=5)
    two = [Feed(spec.loader(r, 2, endless=True), 1, world=2) for r in range(2)]
    three = [Feed(spec.loader(r, 3, endless=True), 1, world=3) for r in range(3)]
    first = [i for feed in two for i in next(feed.epoch(0)).tolist()]
    second = [i for feed in three for i in next(feed.epoch(1)).tolist()]
    assert sorted(first + second) == list(range(24))


def test_iterating_leaves_torchs_global_generator_as_it_was():
    feed = Feed(sampler_loader(0, 1), 4, world=1)
    before = torch.get_rng_state()
    epochs(feed, 0, 3)
    assert torch.equal(before, torch.get_rng_state())


class Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter([(torch.zeros(1), torch.tensor(i)) for i in range(5)])


def test_a_stream_runs_epochs_of_n_batches_and_refuses_to_start_mid_run():
    loader = DataLoader(Stream(), batch_size=2)
    feed = Feed(loader, 2, world=1)
    assert feed.shape() == (None, None)
    assert [len(e) for e in epochs(feed, 0, 3)] == [2, 2, 2]  # a new pass inside epoch 1
    with pytest.raises(ConfigError, match="cannot be put back 4 batches in"):
        epochs(Feed(loader, 2, world=1), 2, 3)


def session(steps: int | None, rank: int = 0, world: int = 1) -> Any:
    return SimpleNamespace(rank=rank, world_size=world, steps_per_epoch=steps)


def test_a_stream_without_steps_per_epoch_is_refused_naming_the_option():
    loader = DataLoader(Stream(), batch_size=2)
    with pytest.raises(ConfigError, match=r"has no len\(\) .* or run with --steps-per-epoch N"):
        _resolve(loader, session(None), "train")
    assert _resolve(loader, session(4), "train") is loader


def test_a_global_batch_the_world_cannot_split_is_refused_naming_the_sizes_that_do():
    spec = epochal.batches(dataset(), global_batch=8)
    with pytest.raises(ConfigError, match="splits evenly over 1, 2, 4, 8 workers, not 3"):
        _resolve(spec, session(None, rank=0, world=3), "train")
    loader = _resolve(spec, session(None, rank=1, world=2), "train")
    assert len(loader) == 3  # type: ignore[arg-type]


def test_batches_refuses_what_it_decides_itself_and_a_stream():
    with pytest.raises(ConfigError, match=r"batches\(\) decides batch_size, sampler itself"):
        epochal.batches(dataset(), global_batch=8, batch_size=4, sampler=None, num_workers=0)
    with pytest.raises(ConfigError, match="reads a map-style dataset"):
        epochal.batches(Stream(), global_batch=8)  # type: ignore[arg-type]
