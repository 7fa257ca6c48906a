"""What a worker says while it waits for its coordinator, and how it gives up.

A worker may start before its coordinator and retries its hello until the connect deadline. So
that a person watching it is never left with silence, :class:`WaitNotices` decides (purely, from
the clock it is given) when to say that the worker is still waiting, where, and for how long
more. When the deadline passes, an uncaught :class:`~epochal.errors.CoordinatorUnreachable` ends
the process with one line and the status
:attr:`~epochal.errors.CoordinatorUnreachable.exit_code` (:mod:`epochal.worker.exits`), which
``epochal worker`` reads as "do not restart: the next attempt would wait the same way".
"""

from __future__ import annotations

from dataclasses import dataclass

from epochal.environment import CONNECT_TIMEOUT_ENV

FIRST_NOTICE_AFTER = 1.0
"""Seconds without an answer before the worker says it is waiting (a live coordinator answers
within milliseconds, so a normal start prints nothing)."""

NOTICE_INTERVAL = 10.0
"""Seconds between the reminders that follow."""


@dataclass(slots=True)
class WaitNotices:
    """When to tell the user that the worker is still waiting for its coordinator."""

    endpoint: str
    deadline_s: float
    # how long the worker retries in all
    started: float
    # when the first hello went out (time.monotonic())
    announced: bool = False
    # True: the wait was already announced (a re-attach says so itself); only reminders follow
    _next: float | None = None

    def due(self, now: float) -> str | None:
        """The line to print at ``now``, or None when nothing is due yet."""
        waited = now - self.started
        if self._next is None:
            self._next = self.started + FIRST_NOTICE_AFTER
            if self.announced:
                self._next = self.started + NOTICE_INTERVAL
        if now < self._next:
            return None
        self._next = now + NOTICE_INTERVAL
        left = max(0.0, self.deadline_s - waited)
        if not self.announced:
            self.announced = True
            return (
                f"epochal: waiting for the coordinator at {self.endpoint}: no answer yet; "
                f"retrying for up to {self.deadline_s:g} s ({CONNECT_TIMEOUT_ENV} sets how long)"
            )
        return (
            f"epochal: still no answer from the coordinator at {self.endpoint} after "
            f"{waited:.0f} s; giving up in {left:.0f} s"
        )
