"""The run as the observers see it: one epoch for the run and for its ranks.

The coordinator decides epoch e and sends the decision, which carries the Go of e + 1, in one
turn; the observers hear of it at the end of that turn, before any rank has said more. Each
rank's last word is then "waiting for e's decision": shown as it is, status.json's header
would say epoch e + 1 and every row epoch e.
"""

from __future__ import annotations

import pytest

from epochal.coordinator.actions import RunPhase
from epochal.coordinator.feed import STARTING, UNHEARD, rank_at, snapshot
from epochal.coordinator.watchdog import RankStatus
from epochal.protocol import Awaiting
from tests.coordinator.test_machine import last, ready, report, start

RUNNING, READY, FINISHING = RunPhase.RUNNING, RunPhase.READY, RunPhase.FINISHING


def said(phase: str, epoch: int, awaiting: Awaiting | None = None) -> RankStatus:
    return RankStatus(phase, epoch, 0, 0.0, awaiting)


@pytest.mark.parametrize(
    ("last_said", "run_phase", "run_epoch", "shown"),
    [
        (None, READY, 4, (UNHEARD, 4)),  # not heard yet: at the run's epoch (a resume's 4)
        (said("train", 3), RUNNING, 3, ("train", 3)),
        (said("checkpoint", 2), RUNNING, 3, ("checkpoint", 2)),  # writing epoch 2's checkpoint
        (said("waiting", 3, Awaiting.DECISION), RUNNING, 3, ("waiting", 3)),  # not decided yet
        (said("waiting", 2, Awaiting.DECISION), RUNNING, 3, (STARTING, 3)),  # its Go was sent
        (said("waiting", 3, Awaiting.DECISION), FINISHING, 3, ("finishing", 3)),  # the last one
        (said("waiting", 0, Awaiting.GO), READY, 0, ("waiting", 0)),  # the others' counts due
        (said("waiting", 0, Awaiting.GO), RUNNING, 0, (STARTING, 0)),  # the Go went out
    ],
)
def test_a_rank_is_where_it_said_unless_its_wait_was_answered(
    last_said: RankStatus | None, run_phase: RunPhase, run_epoch: int, shown: tuple[str, int]
) -> None:
    assert rank_at(last_said, run_phase, run_epoch) == shown


def test_after_a_decision_the_header_and_every_rank_row_say_the_same_epoch() -> None:
    run = start(epochs=3)
    machine = run.machine
    loop = machine._loop  # what the service passes: the run state's loop, the machine's own
    run.all(1.0, ready)
    before = snapshot(machine, loop, "r1", machine.phase, 1.5)
    assert before.epoch == 0 and {(r.phase, r.epoch) for r in before.ranks} == {(STARTING, 0)}
    run.all(2.0, lambda rank: report(4.0, 0))  # epoch 0 decided, epoch 1's Go sent with it
    seen = snapshot(machine, loop, "r1", machine.phase, 2.0)
    assert (seen.state, seen.epoch) == ("running", 1)
    assert [(r.rank, r.phase, r.epoch) for r in seen.ranks] == [(0, STARTING, 1), (1, STARTING, 1)]
    run.all(3.0, lambda rank: report(4.0, 1))
    run.all(4.0, lambda rank: last(4.0, 2))  # the last decision: the run finishes
    seen = snapshot(machine, loop, "r1", machine.phase, 4.0)
    assert (seen.state, seen.epoch) == ("finishing", 2)
    assert {(r.phase, r.epoch) for r in seen.ranks} == {("finishing", 2)}
