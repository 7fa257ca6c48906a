"""What strangers may make the coordinator do is bounded per second in total, on a given clock.

However many identities a flood uses and whatever its frames hold, the time the coordinator
spends on strangers' frames each second stays within STRANGER_SHARE (what each frame took is
measured and counted after it); past that their frames are dropped unread, counted, until the
share refills. A member's frames are never held back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from epochal.coordinator.rules.strangers import STRANGER_BURST, STRANGER_SHARE, Budget, Gate
from epochal.coordinator.serve.intake import Intake
from epochal.protocol import Heartbeat, Hello, encode
from tests.coordinator.test_machine import hello, start


def test_a_budget_spends_its_burst_then_refills_at_its_rate():
    budget = Budget(rate=0.1, burst=0.3)
    opened = []
    for _ in range(4):
        opened.append(budget.open(0.0))
        budget.spend(0.0, 0.1)
    assert opened == [True, True, True, False]
    assert not budget.open(0.5)  # 0.05 back after -0.1: still owed
    assert budget.open(1.5)  # 0.15 back: 0.05 left
    budget.spend(1.5, 0.05)
    assert not budget.open(1.5)
    assert budget.open(100.0)
    budget.spend(100.0, 0.3)  # refilled to its burst, never beyond
    assert not budget.open(100.0)


def test_a_frame_that_took_longer_than_the_share_is_owed_at_most_one_burst():
    budget = Budget(rate=0.1, burst=0.1)
    assert budget.open(0.0)
    budget.spend(0.0, 60.0)  # a minute of work: owed one burst, not a minute
    assert not budget.open(0.99)
    assert budget.open(1.01)  # -0.1 + 0.101


def test_a_clock_that_steps_back_refills_nothing():
    budget = Budget(rate=1.0, burst=1.0)
    budget.spend(10.0, 1.0)
    assert not budget.open(5.0)
    assert not budget.open(10.0)
    assert budget.open(11.5)


def spent_on(gate: Gate, start: float, seconds: float, identities: int, cost: float) -> float:
    """Seconds of work a flood of frames that each take ``cost`` seconds to read, each from a new
    identity, gets done in ``seconds`` (a frame every millisecond of the given clock)."""
    spent = 0.0
    for k in range(int(seconds * 1000)):
        now = start + k / 1000
        if gate.reads(now, f"stranger-{k % identities}".encode()):
            gate.took(now, cost)
            spent += cost
    return spent


@pytest.mark.parametrize("cost", [30e-6, 3e-3, 24e-3, STRANGER_BURST])
def test_strangers_take_their_share_however_many_identities_and_whatever_a_frame_costs(
    cost: float,
):
    for identities in (1, 4, 1000):
        gate = Gate()
        gate.strangers.replies = 10**9  # only the shared budget holds them back here
        seconds = 10.0
        spent = spent_on(gate, 0.0, seconds, identities, cost)
        # the burst, then the share, over by at most the one frame that ran past it
        assert spent <= STRANGER_SHARE * seconds + STRANGER_BURST + cost, (identities, cost)
        demand = cost * 1000 * seconds  # what the flood would take, all of it read
        assert spent >= min(demand, STRANGER_SHARE * seconds) * 0.9 - cost, (identities, cost)
        assert (gate.ignored_frames > 0) == (demand > STRANGER_SHARE * seconds + STRANGER_BURST)


def test_a_members_frames_are_never_held_back():
    gate = Gate()
    gate.strangers.replies = 10**9
    session = gate.sessions.issue(b"member", "")
    assert session
    spent_on(gate, 0.0, 2.0, 8, 0.01)  # the strangers spent the budget
    assert not gate.reads(1.999, b"stranger")
    assert all(gate.reads(2.0, b"member") for _ in range(10_000))


def test_a_spent_stranger_costs_the_budget_nothing():
    gate = Gate()
    for _ in range(gate.strangers.replies):
        gate.reject(b"noisy", "junk", "malformed")
    level = gate.budget._level
    assert not gate.reads(0.0, b"noisy")
    assert gate.budget._level == level


class Ticking:
    """A cost clock that moves ``step`` seconds each time it is read."""

    def __init__(self, step: float) -> None:
        self.step, self.now, self.reads = step, 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


def test_the_intake_counts_what_a_strangers_frame_took_and_never_a_members():
    run = start()
    clock = Ticking(STRANGER_BURST * 0.4)  # each stranger's frame takes 40 % of the burst
    intake = Intake(False, lambda line: None, world_size=2, cost_clock=clock)
    intake.attach(run.machine)
    member = run.peers[0]
    heartbeat = encode(Heartbeat(), session=run.sessions[member])
    for _ in range(100):
        assert intake.receive([member, heartbeat], 1.0) == []
        intake.answered(1.0)
    assert clock.reads == 0  # a member's frames are not timed, and never held back
    stranger = encode(Hello(**{**vars_of(hello("intruder")), "job": "other"}))
    answered = []
    for i in range(6):
        answered.append(bool(intake.receive([f"s{i}".encode(), stranger], 1.0)))
        intake.answered(1.0)  # the answer sent: the frame is charged from its reading to here
    # each read one took 40 % of the burst: the fourth starts with the budget spent
    assert answered == [True, True, True, False, False, False]
    assert clock.reads == 6 and run.machine.gate.ignored_frames == 3  # read and answered: 2 each
    # the share refills at STRANGER_SHARE a second: a joining worker is read again
    assert intake.receive([b"s9", stranger], 1.0 + 2 * STRANGER_BURST / STRANGER_SHARE)


def vars_of(message: Any) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
