"""PassSampler (epochal/worker/training/passes.py): every sample once per pass across world
changes and resumes, the same batches as an uninterrupted run, DistributedSampler's order, and a
loader positioned mid-pass that loads nothing before the position."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from epochal.errors import ConfigError
from epochal.position import DataPosition, batches_per_pass, position_at, split
from epochal.protocol import Go
from epochal.worker.sessionparts.course import Training
from epochal.worker.training.passes import PassSampler, batches
from epochal.worker.training.results import LossSum
from tests.worker.recorded import Recorded


def samplers(world: int, position: DataPosition, **kwargs) -> list[PassSampler]:
    out = []
    for rank in range(world):
        sampler = PassSampler(100, global_batch=12, rank=rank, world=world, seed=7, **kwargs)
        sampler.set_position(position)
        out.append(sampler)
    return out


SCHEDULES = {
    "2-3-2 mid-pass": [2, 2, 3, 3, 3, 2, 2, 2],
    "a change every epoch": [2, 3, 2, 3, 2, 3, 2, 3],
    "same world resumed every epoch": [2] * 8,
    "one worker, then four": [1, 1, 4, 4, 1, 4, 2, 4],
}


@pytest.mark.parametrize("steps", [5, 9, 4])
@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_every_sample_of_each_pass_once_across_world_changes(schedule, steps):
    """An epoch of ``steps`` global batches, in the world ``schedule`` names, every epoch's
    samplers rebuilt from the position alone (a resume or a regroup)."""
    n, per_pass = 100, batches_per_pass(100, 12)  # 9 batches, the last of 4 samples
    seen: dict[int, list[int]] = {}
    consumed = 0
    for world in schedule:
        start = position_at(consumed, per_pass, seed=7)
        streams = [iter(s) for s in samplers(world, start, endless=True)]
        for step in range(steps):
            position = position_at(consumed + step, per_pass, seed=7)
            shares = [next(stream) for stream in streams]
            # each rank's share is its split of the global batch at the position
            whole = samplers(1, position)[0].global_batch_indices(position).tolist()
            assert shares == [split(whole, r, world) for r in range(world)]
            seen.setdefault(position.data_pass, []).extend(x for s in shares for x in s)
        consumed += steps
    finished = consumed // per_pass
    assert finished >= 2  # the run crossed pass boundaries
    for data_pass in range(finished):
        assert sorted(seen[data_pass]) == list(range(n)), f"pass {data_pass}"
    assert len(seen.get(finished, [])) == len(set(seen.get(finished, [])))
    assert seen[0] != seen[1]  # each pass has its own shuffle


def test_a_resume_mid_pass_gives_the_uninterrupted_run_s_batches():
    world, per_pass = 3, batches_per_pass(100, 12)
    resumed: list[list[list[int]]] = [[] for _ in range(world)]
    consumed = 0
    for chunk in (4, 1, 7, 9, 2, 8, 9):  # resumes at, before and after pass ends
        for s in samplers(world, position_at(consumed, per_pass, seed=7), endless=True):
            resumed[s.rank] += itertools.islice(iter(s), chunk)
        consumed += chunk
    uninterrupted = [
        list(itertools.islice(iter(s), consumed))
        for s in samplers(world, DataPosition(0, 0, 7), endless=True)
    ]
    assert resumed == uninterrupted


def test_without_endless_the_iteration_ends_with_the_pass_and_len_counts_what_is_left():
    (sampler,) = samplers(1, DataPosition(3, 6, 7))
    assert len(sampler) == 3
    batches = list(sampler)
    assert [len(b) for b in batches] == [12, 12, 4]
    assert sampler.consumed() == 3 * 9 + 6
    sampler.set_position(DataPosition(3, 9, 7))  # the pass's end: the next pass's start
    assert sampler.position == DataPosition(4, 0, 7) and len(sampler) == 9


def test_the_partial_batch_is_shared_with_one_more_for_the_first_ranks():
    shares = [list(s)[-1] for s in samplers(3, DataPosition(0, 8, 7))]
    assert [len(s) for s in shares] == [2, 1, 1]


def test_drop_last_skips_the_partial_batch():
    (sampler,) = samplers(1, DataPosition(0, 0, 7), drop_last=True)
    assert len(sampler) == 8 and {len(b) for b in sampler} == {12}


def test_without_shuffle_a_pass_is_in_order():
    batches = list(samplers(2, DataPosition(1, 7, 7), shuffle=False)[1])
    assert batches == [[85, 87, 89, 91, 93, 95], [97, 99]]


def test_an_uneven_world_is_refused_naming_the_sizes_that_work():
    with pytest.raises(ConfigError, match=r"splits evenly over 1, 2, 3, 4, 6, 12 workers, not 5"):
        PassSampler(100, global_batch=12, rank=0, world=5)


def test_a_position_of_another_seed_is_refused():
    (sampler,) = samplers(1, DataPosition(0, 0, 7))
    with pytest.raises(ConfigError, match="seed 8, this sampler 7"):
        sampler.set_position(DataPosition(0, 0, 8))
    with pytest.raises(ConfigError, match="past the end of a pass of 9"):
        sampler.set_position(DataPosition(0, 10, 7))


def test_the_order_is_distributed_sampler_s():
    """Moving a script from DistributedSampler(seed, set_epoch(p)) to PassSampler keeps every
    rank's batches, sample for sample."""
    n, world, per_rank = 96, 4, 6
    for data_pass, rank in itertools.product((0, 3), range(world)):
        theirs = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=11)
        theirs.set_epoch(data_pass)
        loader = DataLoader(range(n), batch_size=per_rank, sampler=theirs)
        ours = PassSampler(n, global_batch=per_rank * world, rank=rank, world=world, seed=11)
        ours.set_position(DataPosition(data_pass, 0, 11))
        assert [b.tolist() for b in loader] == list(ours)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_positioned_mid_pass_loads_nothing_before_the_position(tmp_path, workers):
    data = Recorded(100, tmp_path)
    (sampler,) = samplers(1, DataPosition(2, 5, 7))
    (from_start,) = samplers(1, DataPosition(2, 0, 7))
    consumed = [x for b in itertools.islice(from_start, 5) for x in b]
    loader = DataLoader(data, batch_sampler=sampler, num_workers=workers)
    first = next(iter(loader))
    assert first.tolist() == next(iter(sampler))
    if workers == 0:  # no prefetching: exactly the first batch
        assert sorted(data.loaded()) == sorted(first.tolist())
    assert not set(data.loaded()) & set(consumed)
    assert set(data.loaded()) <= set(range(100)) - set(consumed)
    batches = [b.tolist() for b in loader]
    assert sorted(itertools.chain(consumed, *batches)) == list(range(100))


def test_the_permutation_is_drawn_from_seed_plus_pass():
    (sampler,) = samplers(1, DataPosition(0, 0, 7))
    expected = torch.randperm(100, generator=torch.Generator().manual_seed(7 + 4))
    assert torch.equal(sampler.permutation(4), expected)


def test_a_loader_made_at_a_run_s_batch_count_starts_there_and_says_the_pass_s_shape():
    data = batches(list(range(40)), global_batch=8, seed=3)  # 5 global batches a pass
    assert data.shape() == (5, 8)
    whole = PassSampler(40, global_batch=8, rank=1, world=2, seed=3, endless=True)
    expected = list(itertools.islice(iter(whole), 12))
    loader = data.loader(1, 2, start=7, endless=True)  # pass 1, batch 2
    assert list(itertools.islice(loader.batch_sampler, 5)) == expected[7:12]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("steps", "passes", "epoch", "expected"),
    [
        # (steps per epoch, global batches of a pass), epoch -> (done, pass, batch of the pass)
        (3, 5, 0, (0, 0, 0)),
        (3, 5, 2, (6, 1, 1)),
        (3, 5, 5, (15, 3, 0)),
        (3, None, 2, (6, None, None)),  # run_epochs given no passes=: the pass is not known
        (None, None, 4, (4 * 3, 4, 0)),  # an epoch is one pass
    ],
)
def test_an_epoch_s_context_says_where_the_run_s_data_stands_at_its_start(
    steps, passes, epoch, expected
):
    session = SimpleNamespace(steps_per_epoch=steps, rank=1, world_size=2)
    training = Training(
        lambda ctx: LossSum(0.0, 0),
        None,
        (3, None),
        None,
        None,
        None if passes is None else (lambda: (passes, 8)),
    )
    go = Go(epoch=epoch, train_batches=3, valid_batches=0, lr_factor=1.0)
    ctx = training.context(go, session)  # type: ignore[arg-type]
    assert (ctx.batches_done, ctx.data_pass, ctx.pass_batch) == expected
    assert (ctx.steps_per_epoch, ctx.rank, ctx.world_size) == (steps, 1, 2)
