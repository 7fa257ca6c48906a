"""The coordinator's clock rules with a clock the test sets: silence, stalls, lost time, the
strangers' budget and the refusal log."""

from __future__ import annotations

from epochal.coordinator import CoordinatorConfig
from epochal.coordinator.rules.strangers import RefusalLog, Strangers
from epochal.coordinator.rules.watchdog import FAILURE_SETTLE, Watchdog
from epochal.protocol import Status


def dog(**settings: object) -> Watchdog:
    config = CoordinatorConfig(**{"world_size": 2, "epochs": 1, **settings})  # type: ignore[arg-type]
    return Watchdog(config, now=0.0)


def status(phase: str = "train", step: int = 0, where: str = "") -> Status:
    return Status(phase=phase, epoch=0, step=step, where=where)  # type: ignore[arg-type]


def test_the_peer_silent_longest_is_found_without_looking_at_the_others():
    w = dog(heartbeat_timeout=5.0)
    for t, peer in enumerate([b"a", b"b", b"c"]):
        w.heard(peer, float(t))
    w.heard(b"a", 3.0)  # heard again: now the most recent
    assert list(w.last_seen) == [b"b", b"c", b"a"]
    assert w.first_silent(6.0, {b"a", b"b", b"c"}) is None  # b: 5 s, not more
    assert w.first_silent(6.5, {b"a", b"b", b"c"}) == (b"b", 5.5)
    assert w.first_silent(6.5, {b"c", b"a"}) is None  # b is not ranked; c only 4.5 s
    assert w.first_silent(7.5, {b"c", b"a"}) == (b"c", 5.5)
    assert w.silent(7.5) == [b"b", b"c"]


def test_lost_time_moves_every_deadline_and_keeps_the_order():
    w = dog(heartbeat_interval=1.0, heartbeat_timeout=5.0)
    w.heard(b"a", 1.0)
    w.heard(b"b", 2.0)
    w.note_status(0, status(), 2.0)
    w.report_failure(2.0, "rank 1 failed")
    line = w.forgive(30.0, 27.0)
    assert line is not None and "not running for 27.0 s" in line
    assert dict(w.last_seen) == {b"a": 28.0, b"b": 29.0}
    assert w.status[0].since == 29.0 and w.newest == 29.0 and w.phase_started == 27.0
    assert w.failure_deadline == 29.0 + FAILURE_SETTLE
    assert w.forgive(31.0, 0.5) is None  # within a heartbeat interval: not worth a line


def test_progress_is_a_change_of_phase_step_or_line():
    w = dog()
    w.note_status(0, status(step=1, where="a.py:1 in f"), 1.0)
    w.note_status(0, status(step=1, where="a.py:1 in f"), 2.0)
    assert w.status[0].since == 1.0  # the same place: no progress
    w.note_status(0, status(step=1, where="a.py:2 in f"), 3.0)
    assert w.status[0].since == 3.0 and w.newest == 3.0
    w.note_status(0, status(step=2, where="a.py:2 in f"), 4.0)
    assert w.status[0].since == 4.0


def test_a_wait_for_another_answer_is_a_new_wait():
    # a fast epoch may never report its training: waiting for the Go, then for the decision, is
    # all the coordinator sees, and the wait for the decision counts from when it was first seen
    w = dog()
    go = Status(phase="waiting", epoch=0, step=0, where="", awaiting="go")  # type: ignore[arg-type]
    decision = Status(phase="waiting", epoch=0, step=0, where="", awaiting="decision")  # type: ignore[arg-type]
    w.note_status(0, go, 1.0)
    w.note_status(0, go, 2.0)
    assert w.status[0].since == 1.0
    w.note_status(0, decision, 3.0)
    assert (w.status[0].since, w.status[0].awaiting, w.newest) == (3.0, "decision", 3.0)
    w.forgive(4.0, 1.0)
    assert (w.status[0].since, w.status[0].awaiting) == (4.0, "decision")


def test_a_stall_report_is_due_once_per_stall_timeout():
    w = dog(stall_timeout=10.0)
    assert w.stall_due(100.0) is None  # nobody reported: nothing to say
    w.note_status(0, status(), 1.0)
    assert w.stall_due(11.0) is None
    assert w.stall_due(12.0) == 11.0
    assert w.stall_due(21.0) is None
    assert w.stall_due(22.5) == 21.5


def test_a_rank_never_heard_of_counts_its_stall_from_the_phase_start():
    w = dog(stall_abort=10.0)
    w.note_status(0, status(), 1.0)
    w.phase_began(5.0)
    assert not w.stall_abort_due(15.0)  # rank 1 has no status: idle only since 5.0
    assert w.stall_abort_due(15.1)
    w.note_status(1, status(), 5.0)
    assert w.stall_abort_due(15.1)


def test_a_failure_settles_and_puts_causes_first():
    w = dog()
    w.report_failure(1.0, "rank 1 failed")
    w.report_failure(1.1, "worker 1 exited", cause=True)
    assert w.failure_due(1.0 + FAILURE_SETTLE - 0.001) is None
    assert w.failure_due(1.0 + FAILURE_SETTLE) == "worker 1 exited; then rank 1 failed"


def test_a_hello_in_the_middle_of_the_run_is_logged_once_per_heartbeat_timeout():
    w = dog(heartbeat_timeout=5.0)
    assert w.rehello_due(0, 1.0)
    assert not w.rehello_due(0, 5.9)
    assert w.rehello_due(1, 5.9)
    assert w.rehello_due(0, 6.0)


def test_a_stranger_is_answered_a_few_times_and_the_least_recent_forgotten():
    strangers = Strangers(replies=2, remembered=2)
    assert [strangers.answer(b"x") for _ in range(3)] == [True, True, False]
    assert strangers.spent(b"x")
    strangers.answer(b"y")
    strangers.answer(b"z")  # x is the least recent of three: forgotten
    assert not strangers.spent(b"x")


def test_refusals_are_logged_a_few_a_minute_and_the_rest_counted():
    log = RefusalLog(per_minute=2)
    assert [log.lines(100.0 + i, f"r{i}") for i in range(4)] == [["r0"], ["r1"], [], []]
    assert log.lines(160.5, "r4") == ["... and 2 more refusals in that minute", "r4"]
