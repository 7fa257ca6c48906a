"""ShardSampler: disjoint shards whose union is the dataset, equal batch counts, per-epoch order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochal.errors import ConfigError
from epochal.worker.training.sharding import ShardSampler


def batches(n: int, b: int, w: int, seed: int = 0, epoch: int = 0) -> list[list[list[int]]]:
    out = []
    for r in range(w):
        s = ShardSampler(n, b, rank=r, world_size=w, seed=seed)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 8), b=st.integers(2, 64), n=st.integers(1, 3000), seed=st.integers(0, 99))
def test_shards_partition_the_dataset_with_equal_batch_counts(w, b, n, seed):
    if n < w:
        with pytest.raises(ConfigError):
            ShardSampler(n, b, rank=0, world_size=w)
        return
    per_rank = batches(n, b, w, seed)
    counts = {len(rank) for rank in per_rank}
    assert counts == {-(-n // (w * b))}
    flat = [i for rank in per_rank for batch in rank for i in batch]
    assert sorted(flat) == list(range(n))  # disjoint, and the union is the dataset
    sizes = [len(batch) for rank in per_rank for batch in rank]
    assert max(sizes) <= b and min(sizes) >= 1
    for rank in per_rank:
        assert max(map(len, rank)) - min(map(len, rank)) <= 1


def test_each_epoch_has_its_own_permutation_and_it_is_reproducible():
    a, b = batches(100, 10, 2, seed=5, epoch=0), batches(100, 10, 2, seed=5, epoch=1)
    assert a != b
    assert a == batches(100, 10, 2, seed=5, epoch=0)
    assert len(ShardSampler(100, 10, rank=0, world_size=2)) == 5


def test_impossible_splits_are_refused_with_advice():
    with pytest.raises(ConfigError, match="use a batch size of at least 2"):
        ShardSampler(5, 1, rank=0, world_size=2)
    with pytest.raises(ConfigError, match=r"rank 2 is outside 0\.\.1"):
        ShardSampler(5, 2, rank=2, world_size=2)


def test_train_sets_the_epoch_of_the_sampler_and_of_the_batch_sampler_as_the_guide_says():
    # docs/worker-api.md, "The sampler's epoch": epochal.train calls set_epoch(epoch) on the
    # training loader's sampler and batch_sampler, wherever one has the method
    from torch.utils.data import DataLoader, DistributedSampler

    from epochal.worker.training.positioning import set_epochs

    data = list(range(40))
    by_sampler = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 1))
    by_batches = DataLoader(data, batch_sampler=ShardSampler(40, 4, rank=0, world_size=2))
    for loader in (by_sampler, by_batches):
        before = [batch.tolist() for batch in loader]
        set_epochs(loader, 7)
        holders = (loader.sampler, loader.batch_sampler)
        assert [h.epoch for h in holders if hasattr(h, "epoch")] == [7]
        assert [batch.tolist() for batch in loader] != before  # the epoch's own permutation
    set_epochs(DataLoader(data, batch_size=4), 7)  # nothing to set: no error
