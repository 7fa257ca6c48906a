"""Liveness with explicit clock values: no sleeps, no real clock."""

from __future__ import annotations

import pytest

from epochal.coordinator.rules.liveness import (
    Progress,
    culprit,
    expired,
    lost,
    moved,
    stall_table,
    stalled,
)


@pytest.mark.parametrize(
    ("now", "last_seen", "timeout", "expected"),
    [
        (100.0, 100.0, 15.0, False),  # just heard
        (114.0, 100.0, 15.0, False),
        (115.0, 100.0, 15.0, False),  # exactly the timeout: not yet
        (115.001, 100.0, 15.0, True),
        (1000.0, 100.0, 15.0, True),
        (90.0, 100.0, 15.0, False),  # seen "after" now (a clock read out of order): alive
        (0.5, 0.0, 0.25, True),
    ],
)
def test_expired_only_after_more_than_the_timeout(
    now: float, last_seen: float, timeout: float, expected: bool
):
    assert expired(now, last_seen, timeout) is expected


def test_nobody_is_lost_while_everyone_spoke_recently():
    assert lost(20.0, {b"a": 10.0, b"b": 19.0, b"c": 5.0}, 15.0) == []


def test_nobody_is_lost_from_an_empty_table():
    assert lost(1e9, {}, 1.0) == []


def test_the_silent_peers_are_lost_oldest_first():
    last_seen = {b"recent": 99.0, b"older": 50.0, b"oldest": 10.0, b"edge": 85.0, b"old": 70.0}
    assert lost(100.0, last_seen, 15.0) == [b"oldest", b"older", b"old"]


def test_peers_silent_since_the_same_moment_keep_their_table_order():
    last_seen = {3: 1.0, 1: 1.0, 2: 0.5}
    assert lost(100.0, last_seen, 15.0) == [2, 3, 1]


def test_keys_need_not_be_comparable():
    a, b = object(), object()
    assert lost(100.0, {a: 1.0, b: 1.0}, 15.0) == [a, b]


def test_the_same_table_read_later_loses_more():
    last_seen = {"r0": 0.0, "r1": 10.0, "r2": 20.0}
    assert lost(15.0, last_seen, 15.0) == []
    assert lost(15.5, last_seen, 15.0) == ["r0"]
    assert lost(25.0, last_seen, 15.0) == ["r0"]
    assert lost(25.5, last_seen, 15.0) == ["r0", "r1"]
    assert lost(36.0, last_seen, 15.0) == ["r0", "r1", "r2"]


# ---------------------------------------------------------------- stalls: who the others wait for

IN_BACKWARD = "graph.py:829 in _engine_run_backward"  # DDP's all-reduce completes in backward
IN_COLLECTIVE = "distributed_c10d.py:2931 in all_reduce"
HUNG_LOADER = "train.py:40 in __iter__"


def row(rank, phase, epoch, step, idle, where):
    return Progress(rank, phase, epoch, step, idle, where)


@pytest.mark.parametrize(
    ("rows", "stuck"),
    [
        # a hang in the validation loader: the others reported and wait for the coordinator
        (
            [
                row(0, "waiting", 3, 0, 40.0, "client.py:120 in receive"),
                row(1, "validate", 3, 2, 38.0, HUNG_LOADER),
                row(2, "waiting", 3, 0, 41.0, "client.py:120 in receive"),
            ],
            1,
        ),
        # a hang in the training loop: the others wait inside a collective, and went quiet
        # before the stuck rank did (its last step began later): "oldest progress" would blame 0
        (
            [
                row(0, "train", 1, 3, 50.0, IN_BACKWARD),
                row(1, "train", 1, 3, 49.0, IN_COLLECTIVE),
                row(2, "train", 1, 3, 47.0, "faults.py:88 in hit"),
            ],
            2,
        ),
        # everybody waits in the framework (a collective that never completes): the least advanced
        (
            [
                row(0, "train", 2, 7, 30.0, IN_BACKWARD),
                row(1, "train", 2, 6, 30.0, IN_BACKWARD),
            ],
            1,
        ),
        # two ranks stuck in their own code: the one behind
        (
            [
                row(0, "validate", 2, 1, 30.0, HUNG_LOADER),
                row(1, "train", 2, 9, 20.0, HUNG_LOADER),
                row(2, "waiting", 2, 0, 31.0, "client.py:120 in receive"),
            ],
            1,
        ),
        # equally far: the one idle the longest
        (
            [row(0, "train", 0, 1, 10.0, HUNG_LOADER), row(1, "train", 0, 1, 12.0, HUNG_LOADER)],
            1,
        ),
    ],
)
def test_the_culprit_is_the_rank_stuck_in_its_own_code(rows, stuck):
    found = culprit(rows)
    assert found is not None and found.rank == stuck


def test_no_rows_no_culprit():
    assert culprit([]) is None


VALIDATION_HANG = [
    row(0, "waiting", 3, 0, 0.0, "client.py:120 in receive"),
    row(1, "validate", 3, 2, 0.0, HUNG_LOADER),
]


def at(rows, idle):
    """The same ranks, ``idle`` seconds later with no progress."""
    return [Progress(r.rank, r.phase, r.epoch, r.step, r.idle + idle, r.where) for r in rows]


@pytest.mark.parametrize(
    ("idle", "abort_after", "verdict"),
    [
        (29.0, 30.0, None),
        (30.0, 30.0, None),  # exactly the bound: not yet
        (30.5, 30.0, 1),
        (5000.0, None, None),  # never
        (0.5, 0.25, 1),
    ],
)
def test_a_stall_ends_the_run_only_past_the_bound(idle, abort_after, verdict):
    result = stalled(at(VALIDATION_HANG, idle), abort_after)
    if verdict is None:
        assert result is None
    else:
        assert result is not None and result.rank == verdict
        assert f"rank 1 made no progress for {idle:.0f} s in validate of epoch 3" in result.reason
        assert HUNG_LOADER in result.reason and "--stall-abort" in result.reason


def test_no_abort_while_any_rank_progresses():
    rows = [row(0, "train", 1, 3, 100.0, IN_BACKWARD), row(1, "train", 1, 9, 2.0, HUNG_LOADER)]
    assert stalled(rows, 30.0) is None  # rank 1 is slow, not stuck: rank 0 waits for it
    assert stalled(at(rows, 29.0), 30.0) is not None


def test_the_stall_table_marks_the_culprit_not_the_oldest():
    table = stall_table(
        [
            (0, "a", "train", 1, 3, 50.0, IN_BACKWARD),
            (1, "b", "train", 1, 3, 47.0, "faults.py:88 in hit"),
        ]
    )
    lines = {line.split()[0]: line for line in table.splitlines() if line[:1].isdigit()}
    assert "*" in lines["1"]
    assert "*" not in lines["0"]
    assert "the rank the others wait for" in table


@pytest.mark.parametrize(
    ("before", "after", "progress"),
    [
        (None, "train.py:10 in step", False),  # the first heartbeat: nothing to compare
        ("train.py:10 in step", "train.py:10 in step", False),  # hung, or blocked on one line
        ("train.py:10 in step", "train.py:14 in step", True),  # a loop without ctx.check()
        (IN_BACKWARD, IN_BACKWARD, False),  # waiting in a collective
        ("train.py:10 in step", "", False),  # unknown
        ("", "train.py:10 in step", False),
    ],
)
def test_a_changed_line_counts_as_progress(before, after, progress):
    assert moved(before, after) is progress
