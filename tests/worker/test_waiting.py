"""When a worker waiting for its coordinator speaks up: a pure rule, tested with a given clock."""

from __future__ import annotations

from epochal.worker.control.waiting import FIRST_NOTICE_AFTER, NOTICE_INTERVAL, WaitNotices


def test_the_wait_is_announced_once_then_reminded_at_intervals():
    notices = WaitNotices("tcp://10.0.0.5:29400", 120.0, started=100.0)
    assert notices.due(100.0) is None  # a live coordinator answers before anything is said
    first = notices.due(100.0 + FIRST_NOTICE_AFTER)
    assert first == (
        "epochal: waiting for the coordinator at tcp://10.0.0.5:29400: no answer yet; retrying "
        "for up to 120 s (EPOCHAL_CONNECT_TIMEOUT sets how long)"
    )
    assert notices.due(100.0 + FIRST_NOTICE_AFTER + NOTICE_INTERVAL - 0.5) is None
    reminder = notices.due(100.0 + FIRST_NOTICE_AFTER + NOTICE_INTERVAL)
    assert reminder == (
        "epochal: still no answer from the coordinator at tcp://10.0.0.5:29400 after 11 s; "
        "giving up in 109 s"
    )
    assert notices.due(100.0 + 12.0) is None


def test_a_wait_already_announced_gets_only_reminders():
    notices = WaitNotices("ipc:///tmp/c", 60.0, started=0.0, announced=True)
    assert notices.due(FIRST_NOTICE_AFTER) is None
    reminder = notices.due(NOTICE_INTERVAL)
    assert reminder is not None and reminder.startswith("epochal: still no answer")
