"""What a worker says while it waits for its coordinator, and how it gives up.

A worker may start before its coordinator and retries its hello until the connect deadline. So that
a person watching it is never left with silence, :class:`WaitNotices` decides (purely, from the
clock it is given) when to say that the worker is still waiting, where, and for how long more. When
the deadline passes, an uncaught :class:`~epochal.errors.CoordinatorUnreachable` ends the process
with one line and the status :attr:`~epochal.errors.CoordinatorUnreachable.exit_code`
(:mod:`epochal.worker.control.exits`), which ``epochal worker`` reads as "do not restart: the next
attempt would wait the same way". :class:`Handshake` follows the connection's ZeroMQ handshakes, so
that the line tells a coordinator that does not answer a connection (stopped, overloaded, out of
file descriptors) from one nobody listens for, and blames CURVE only where CURVE is in play.
"""

from __future__ import annotations

from dataclasses import dataclass

from epochal.environment import CONNECT_TIMEOUT_ENV, CURVE_SERVER_KEY_ENV

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


@dataclass(slots=True)
class Handshake:
    """The ZeroMQ handshakes of a worker's connection to its coordinator, from its socket
    monitor's events (the clock is an argument): whether the coordinator answers a connection."""

    endpoint: str
    timeout: float
    # seconds a handshake may take (the socket's ZMQ_HANDSHAKE_IVL): past them it fails
    curve: bool
    # this worker uses CURVE
    _opened: float | None = None
    # when the current connection opened, while its handshake has not completed
    _unanswered_since: float | None = None
    # when the first connection opened whose handshake never completed (None: the last did)
    _closed: int = 0
    # connections the peer closed during their handshake, since the last one that completed
    _timed_out: int = 0
    # handshakes that ran out of time, likewise

    def connected(self, now: float) -> None:
        """A connection opened (ZMQ_EVENT_CONNECTED); its handshake starts."""
        self._opened = now
        if self._unanswered_since is None:
            self._unanswered_since = now

    def succeeded(self) -> None:
        """The handshake completed: the coordinator answers."""
        self._opened = self._unanswered_since = None
        self._closed = self._timed_out = 0

    def failed(self, now: float) -> bool:
        """A handshake failed without detail: whether the peer closed the connection during it
        (else it ran out of time: nothing answered)."""
        opened, self._opened = self._opened, None
        closed = opened is not None and now - opened < 0.9 * self.timeout
        if closed:
            self._closed += 1
        else:
            self._timed_out += 1
        return closed

    def unanswered(self, now: float) -> str | None:
        """Why no answer came, when a connection opened and its handshake never completed; None
        when none opened (nobody listens) or the last handshake completed."""
        since = self._unanswered_since
        if since is None:
            return None
        waited = now - since
        if self._closed and not self._timed_out:
            what = (
                f"it accepted {self._closed} connections and closed each during the ZeroMQ "
                f"handshake within {waited:.0f} s (is the address an epochal coordinator's?)"
            )
        else:
            what = (
                f"its port accepted the connection, but the coordinator did not complete the "
                f"ZeroMQ handshake for {waited:.0f} s (it is stopped, overloaded or out of file "
                "descriptors, or the address is not an epochal coordinator's)"
            )
        hint = (
            f"; this worker uses CURVE: check that {CURVE_SERVER_KEY_ENV} names the "
            "coordinator.key of that coordinator's key directory"
            if self.curve
            else ""
        )
        return f"the coordinator at {self.endpoint} does not answer: {what}{hint}"
