"""Positioning a loader epochal does not own (epochal/worker/training/positioning.py): a user's
DataLoader skips its consumed batches without loading them; a stream is put back by its own
state_dict, or refused with what to use."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset

from epochal.errors import ConfigError
from epochal.worker.training.positioning import (
    set_stream_position,
    skip_consumed,
    stream_position,
)
from tests.worker.recorded import Recorded


def ids(loader: DataLoader[Any]) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def distributed_loader(data: Dataset[Any], workers: int, rank: int = 1) -> DataLoader[Any]:
    sampler = DistributedSampler(data, num_replicas=3, rank=rank, seed=5)  # type: ignore[arg-type]
    return DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers, drop_last=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_skipped_loader_yields_the_tail_and_loads_no_consumed_sample(tmp_path, workers):
    data = Recorded(100, tmp_path)
    loader = distributed_loader(data, workers)
    loader.sampler.set_epoch(3)  # type: ignore[attr-defined]
    whole = ids(loader)
    assert len(whole) == 8  # 34 samples for rank 1, in batches of 4, the partial one dropped
    data.forget()
    loader.sampler.set_epoch(0)  # type: ignore[attr-defined]  # skip_consumed sets the pass
    skipped = skip_consumed(loader, 3, 5)
    assert len(skipped) == 3
    assert ids(skipped) == whole[5:]
    consumed = {i for batch in whole[:5] for i in batch}
    assert not consumed & set(data.loaded())
    assert sorted(data.loaded()) == sorted(i for batch in whole[5:] for i in batch)
    assert skipped.num_workers == workers and skipped.collate_fn is loader.collate_fn


def test_a_batch_sampler_of_the_user_s_is_skipped_and_told_the_pass(tmp_path):
    data = Recorded(60, tmp_path)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, seed=1)  # type: ignore[arg-type]
    loader = DataLoader(data, batch_sampler=BatchSampler(sampler, 5, drop_last=False))
    sampler.set_epoch(2)
    whole = ids(loader)
    data.forget()
    assert ids(skip_consumed(loader, 2, 4)) == whole[4:]
    assert not {i for b in whole[:4] for i in b} & set(data.loaded())


def test_a_loader_without_batching_skips_samples(tmp_path):
    data = Recorded(10, tmp_path)
    loader = DataLoader(data, batch_size=None)
    tail = list(skip_consumed(loader, 0, 7))
    assert tail == [7, 8, 9] and sorted(data.loaded()) == [7, 8, 9]


def test_skipping_past_the_pass_leaves_nothing(tmp_path):
    loader = distributed_loader(Recorded(100, tmp_path), 0)
    skipped = skip_consumed(loader, 0, 8)
    assert len(skipped) == 0 and ids(skipped) == []


def test_a_shuffle_from_the_global_random_state_is_refused(tmp_path):
    loader = DataLoader(Recorded(10, tmp_path), batch_size=2, shuffle=True)
    with pytest.raises(ConfigError, match="RandomSampler that has no generator"):
        skip_consumed(loader, 1, 2)
    seeded = DataLoader(
        Recorded(10, tmp_path), batch_size=2, shuffle=True, generator=torch.Generator()
    )
    assert len(skip_consumed(seeded, 1, 2)) == 3


class Stream(IterableDataset[int]):
    def __iter__(self):
        return iter(range(10))


def test_a_stream_cannot_be_skipped_and_is_told_what_to_use():
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        skip_consumed(DataLoader(Stream(), batch_size=2), 0, 1)


class StatefulStreamLoader:
    """What torchdata's StatefulDataLoader offers a resume: where it stands, and back there."""

    def __init__(self) -> None:
        self.handed_out = 0

    def __iter__(self):
        while self.handed_out < 10:
            self.handed_out += 1
            yield self.handed_out - 1

    def state_dict(self) -> dict[str, Any]:
        return {"handed_out": self.handed_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.handed_out = state_dict["handed_out"]


def test_a_stateful_stream_is_put_back_where_it_stood():
    first = StatefulStreamLoader()
    stream = iter(first)
    head = [next(stream) for _ in range(4)]
    state = stream_position(first)
    again = StatefulStreamLoader()
    set_stream_position(again, state)
    assert head + list(again) == list(range(10))


def test_a_loader_without_state_is_refused_naming_what_to_use():
    loader = DataLoader(Stream(), batch_size=2)
    for call in (lambda: stream_position(loader), lambda: set_stream_position(loader, {})):
        with pytest.raises(ConfigError, match=r"DataLoader cannot say where it stands.*"):
            call()
    with pytest.raises(ConfigError, match="StatefulDataLoader"):
        stream_position(loader)
