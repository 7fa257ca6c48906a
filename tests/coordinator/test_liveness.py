"""Liveness with explicit clock values: no sleeps, no real clock."""

from __future__ import annotations

import pytest

from epochal.coordinator.liveness import expired, lost


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
