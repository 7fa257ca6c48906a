"""What strangers may make the coordinator read is bounded per second in total, on a given clock.

However many identities a flood uses, the bytes of strangers' frames the coordinator reads each
second stay within STRANGER_BYTES_PER_SECOND (each frame charged STRANGER_FRAME_BYTES beyond its
size); past that their frames are dropped unread, counted, until the budget refills. A member's
frames are never held back.
"""

from __future__ import annotations

from epochal.coordinator.strangers import (
    STRANGER_BYTES_PER_SECOND,
    STRANGER_FRAME_BYTES,
    Budget,
    Gate,
)
from epochal.protocol import MAX_FRAME_BYTES


def test_a_budget_spends_its_burst_then_refills_at_its_rate():
    budget = Budget(rate=100.0, burst=300.0)
    assert [budget.take(0.0, 100.0) for _ in range(4)] == [True, True, True, False]
    assert not budget.take(0.5, 100.0)  # 50 back: not enough
    assert budget.take(1.0, 100.0)  # 100 back after one second
    assert not budget.take(1.0, 1.0)
    assert budget.take(100.0, 300.0)  # refilled to its burst, never beyond
    assert not budget.take(100.0, 1.0)


def test_a_clock_that_steps_back_refills_nothing():
    budget = Budget(rate=100.0, burst=100.0)
    assert budget.take(10.0, 100.0)
    assert not budget.take(5.0, 1.0)
    assert not budget.take(10.0, 1.0)
    assert budget.take(11.0, 100.0)


def read_in(gate: Gate, start: float, seconds: float, identities: int, size: int) -> int:
    """Bytes a flood of maximum-size frames, each from a new identity, gets read in ``seconds``
    (a frame every millisecond of the given clock)."""
    read = 0
    for k in range(int(seconds * 1000)):
        now = start + k / 1000
        if gate.reads(now, f"stranger-{k % identities}".encode(), size):
            read += size + STRANGER_FRAME_BYTES
    return read


def test_strangers_are_read_within_the_budget_however_many_identities_they_use():
    for identities in (1, 4, 1000):
        gate = Gate()
        gate.strangers.replies = 10**9  # only the shared budget holds them back here
        seconds = 10.0
        read = read_in(gate, 0.0, seconds, identities, MAX_FRAME_BYTES)
        # the burst, then the rate: never more, whoever sends
        assert read <= STRANGER_BYTES_PER_SECOND * (seconds + 1), identities
        assert read >= STRANGER_BYTES_PER_SECOND * seconds * 0.9, identities
        assert gate.ignored_frames > 0


def test_a_members_frames_are_never_held_back():
    gate = Gate()
    gate.strangers.replies = 10**9
    session = gate.sessions.issue(b"member", "")
    assert session
    read_in(gate, 0.0, 2.0, 8, MAX_FRAME_BYTES)  # the strangers spent the budget
    assert not gate.reads(1.999, b"stranger", MAX_FRAME_BYTES)
    assert all(gate.reads(2.0, b"member", MAX_FRAME_BYTES) for _ in range(10_000))


def test_a_spent_stranger_costs_the_budget_nothing():
    gate = Gate()
    for _ in range(gate.strangers.replies):
        gate.reject(b"noisy", "junk", "malformed")
    level = gate.budget._level
    assert not gate.reads(0.0, b"noisy", MAX_FRAME_BYTES)
    assert gate.budget._level == level
