"""The data position's math (epochal/position.py): counter to position and back, offsets, the
strided split, and which world sizes a global batch allows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epochal.errors import ConfigError
from epochal.position import (
    DataPosition,
    advance,
    batch_bounds,
    batches_before,
    batches_per_pass,
    check_world,
    data_offset,
    position_at,
    split,
    worlds_that_split,
)


@pytest.mark.parametrize(
    ("samples", "batch", "drop_last", "expected"),
    [
        (100, 10, False, 10),
        (101, 10, False, 11),
        (109, 10, False, 11),
        (101, 10, True, 10),
        (7, 10, False, 1),
        (10, 10, True, 1),
    ],
)
def test_batches_per_pass(samples, batch, drop_last, expected):
    assert batches_per_pass(samples, batch, drop_last=drop_last) == expected


def test_drop_last_with_no_full_batch_is_refused_naming_the_sizes():
    with pytest.raises(ConfigError, match=r"7 samples, fewer than one global batch of 10"):
        batches_per_pass(7, 10, drop_last=True)


@pytest.mark.parametrize(
    ("g", "expected"),
    [(0, (0, 0)), (1, (0, 1)), (10, (0, 10)), (11, (1, 0)), (12, (1, 1)), (33, (3, 0))],
)
def test_position_at_a_pass_end_is_the_next_pass_start(g, expected):
    pos = position_at(g, 11, seed=5)
    assert (pos.data_pass, pos.batch, pos.seed) == (*expected, 5)


@given(st.integers(0, 10**9), st.integers(1, 10**6))
def test_batches_before_inverts_position_at(g, per_pass):
    pos = position_at(g, per_pass)
    assert 0 <= pos.batch < per_pass
    assert batches_before(pos, per_pass) == g


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 10**4))
def test_advance_adds_batches_across_passes(g, more, per_pass):
    assert advance(position_at(g, per_pass), more, per_pass) == position_at(g + more, per_pass)


def test_a_position_past_the_pass_is_refused():
    assert batches_before(DataPosition(2, 11), 11) == 33  # a pass just ended: the next's start
    with pytest.raises(ConfigError, match="past the end of a pass of 11"):
        batches_before(DataPosition(2, 12), 11)
    with pytest.raises(ConfigError, match="counts up from 0"):
        DataPosition(-1, 0)


def test_data_offset_and_bounds_of_the_last_partial_batch():
    assert data_offset(DataPosition(3, 4), 105, 10) == 40
    assert data_offset(DataPosition(3, 11), 105, 10) == 105
    assert batch_bounds(0, 105, 10) == (0, 10)
    assert batch_bounds(10, 105, 10) == (100, 105)
    with pytest.raises(ConfigError, match="global batch 11 lies outside"):
        batch_bounds(11, 105, 10)


def test_split_is_strided_and_its_shares_make_the_batch():
    batch = list(range(100, 112))
    assert split(batch, 1, 3) == [101, 104, 107, 110]
    for world in (1, 2, 3, 4, 6, 12):
        shares = [split(batch, r, world) for r in range(world)]
        assert sorted(x for s in shares for x in s) == batch
        assert {len(s) for s in shares} == {12 // world}


def test_split_of_a_partial_batch_gives_the_first_ranks_one_more():
    shares = [split(list(range(5)), r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [2, 2, 1]


def test_worlds_that_split():
    assert worlds_that_split(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert worlds_that_split(1) == [1]
    assert worlds_that_split(49) == [1, 7, 49]


def test_an_uneven_world_is_refused_naming_the_sizes_that_work():
    check_world(8, 96)
    with pytest.raises(ConfigError) as err:
        check_world(5, 96)
    assert (
        "a global batch of 96 splits evenly over 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96 "
        "workers, not 5" in str(err.value)
    )
    assert "e.g. 100" in str(err.value)


def test_a_world_larger_than_the_last_partial_batch_is_refused_unless_it_is_dropped():
    check_world(4, 12, samples=100)  # last batch: 4 samples, one per worker
    with pytest.raises(ConfigError, match=r"holds 4 samples .* fewer than the 6 workers"):
        check_world(6, 12, samples=100)
    check_world(6, 12, samples=100, drop_last=True)
    check_world(6, 12, samples=96)  # no partial batch
