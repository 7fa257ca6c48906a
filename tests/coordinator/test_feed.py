"""The run as the observers see it: one epoch for the run and for its ranks.

The coordinator decides epoch e and sends the decision, which carries the Go of e + 1, in one
turn; the observers hear of it at the end of that turn, before any rank has said more. Each
rank's last word is then "waiting for e's decision": shown as it is, status.json's header
would say epoch e + 1 and every row epoch e.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.actions import RunPhase
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.watchdog import RankStatus
from epochal.coordinator.serve import resume
from epochal.coordinator.serve.feed import (
    JOIN_TELL_SECONDS,
    SNAPSHOT_SHARE,
    STARTING,
    UNHEARD,
    ObserverFeed,
    epoch_ends_in,
    rank_at,
    snapshot,
)
from epochal.observe import RunObserver, StatusSnapshot, World
from epochal.protocol import Awaiting, Phase, Status
from tests.conftest import hello
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


def test_each_rank_row_says_how_many_steps_its_phase_has_and_when_the_epoch_ends() -> None:
    run = start(epochs=3)
    machine = run.machine
    run.all(1.0, ready)  # epoch 0: 5 train batches, 2 validation batches on every rank
    run.send(3.0, run.peers[0], Status(Phase.TRAIN, 0, 2, "train.py:9 in step"))
    run.send(3.0, run.peers[1], Status(Phase.VALIDATE, 0, 1, "train.py:20 in check"))
    seen = snapshot(machine, machine._loop, "r1", machine.phase, 3.0)
    assert [(r.phase, r.step, r.steps) for r in seen.ranks] == [("train", 2, 5), ("validate", 1, 2)]
    # the slowest rank did 2 of the epoch's 7 batches in the 2 s since its Go: 5 more take 5 s
    assert seen.epoch_ends_in == pytest.approx(5.0)
    assert epoch_ends_in(machine.plan, [], 2.0) is None  # no rank with a rate to go by


class Heard(RunObserver):
    """What the observers were told, in order: ("epoch", record's epoch, snapshot's time),
    ("status", snapshot's time), ("end",)."""

    def __init__(self) -> None:
        self.told: list[tuple[Any, ...]] = []

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        self.told.append(("epoch", record["epoch"], status.time))

    def on_status(self, snapshot: StatusSnapshot) -> None:
        self.told.append(("status", snapshot.time))

    def on_end(self, result: Mapping[str, Any]) -> None:
        self.told.append(("end",))


def test_snapshots_take_at_most_their_share_and_what_waits_is_told_in_order() -> None:
    """A snapshot that took 10 ms of the feed's clock holds the next one back for
    10 ms * (1 - share) / share; the records written meanwhile wait, in order, for it, and the
    end tells whatever waits before it."""
    machine = start(epochs=3).machine
    clock = [0.0]
    took = 0.01

    def make() -> StatusSnapshot:
        clock[0] += took
        seen = snapshot(machine, machine._loop, "r1", machine.phase, clock[0])
        return dataclasses.replace(seen, time=clock[0])  # which snapshot the observers got

    heard = Heard()
    feed = ObserverFeed(heard, clock=lambda: clock[0])
    feed.written({"kind": "epoch", "epoch": 0})
    feed.tell(machine, True, make)
    assert heard.told == [("epoch", 0, took)]
    due = took * (1 - SNAPSHOT_SHARE) / SNAPSHOT_SHARE + took  # from the end of the first
    clock[0] = due - 0.001
    feed.written({"kind": "epoch", "epoch": 1})
    feed.heartbeat_sent()
    feed.tell(machine, True, make)
    feed.written({"kind": "epoch", "epoch": 2})
    feed.tell(machine, True, make)
    assert heard.told == [("epoch", 0, took)]  # not due: both records and the beat wait
    clock[0] = due
    feed.tell(machine, True, make)
    then = due + took
    assert heard.told[1:] == [("epoch", 1, then), ("epoch", 2, then), ("status", then)]
    feed.written({"kind": "epoch", "epoch": 3})  # long before the next is due
    feed.end({"status": "finished"}, machine, make)
    assert heard.told[4:] == [("epoch", 3, then + took), ("end",)]


class Joins(RunObserver):
    def __init__(self) -> None:
        self.told: list[int] = []

    def on_join(self, world: World) -> None:
        self.told.append(world.joined)


def test_a_rendezvous_count_is_told_at_most_every_interval_and_the_full_set_at_once() -> None:
    """Hellos a few milliseconds apart: the first count is told, the next ones wait for
    JOIN_TELL_SECONDS and are then told as one (the count at that turn, even one that changed
    nothing); the hello that completes the set is told at once, and so is a worker leaving."""
    config = CoordinatorConfig(world_size=5, epochs=1)
    machine = RunMachine(config, resume.inspect(config, None), run_id="r1", now=0.0)
    clock = [0.0]
    heard = Joins()
    feed = ObserverFeed(heard, clock=lambda: clock[0])

    def join(i: int, at: float) -> None:
        clock[0] = at
        machine.on_message(at, f"w{i}".encode(), hello(f"w{i}"), session="")
        feed.tell(machine, True, lambda: pytest.fail("no snapshot is due"))

    join(0, 0.0)
    join(1, 0.01)
    join(2, 0.02)
    assert heard.told == [1]  # 2 and 3 wait
    clock[0] = JOIN_TELL_SECONDS - 0.001
    feed.tell(machine, True, lambda: pytest.fail("no snapshot is due"))
    assert heard.told == [1]
    clock[0] = JOIN_TELL_SECONDS
    feed.tell(machine, True, lambda: pytest.fail("no snapshot is due"))  # a turn with no hello
    assert heard.told == [1, 3]
    join(3, JOIN_TELL_SECONDS + 0.01)
    machine.rendezvous.leave(b"w3")  # it went silent before the set was complete
    feed.tell(machine, True, lambda: pytest.fail("no snapshot is due"))
    assert heard.told == [1, 3]  # 4 was never told, and 3 is what was: nothing to tell
    machine.rendezvous.leave(b"w2")
    feed.tell(machine, True, lambda: pytest.fail("no snapshot is due"))
    assert heard.told == [1, 3, 2]  # a fall is told at once
    join(2, JOIN_TELL_SECONDS + 0.02)
    join(3, JOIN_TELL_SECONDS + 0.03)
    join(4, JOIN_TELL_SECONDS + 0.04)
    assert heard.told[-1] == 5  # the full set at once; its ranks are told as they are assigned
