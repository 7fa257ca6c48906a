"""The operating-system limits a coordinator of thousands of workers runs into, raised or named.

Every worker holds one TCP connection to the coordinator's ROUTER socket, so the coordinator needs
one file descriptor per worker besides its own few. Two limits of the operating system stand in
the way long before ZeroMQ does:

- the soft ``RLIMIT_NOFILE`` (``ulimit -n``), often 1,024: the coordinator raises it to the hard
  limit at startup (:func:`raise_nofile_limit`), which any process may do. When a connection still
  cannot be accepted, libzmq reports ``EMFILE`` only as a socket-monitor event, leaves the
  connection waiting in the listen queue and retries it at every turn of its I/O thread; the
  worker then looks merely missing. :class:`AcceptFailures` counts those events (a note for the
  rendezvous timeout), :func:`files_shortage_message` names the limit and who holds the
  descriptors, and :class:`AcceptMonitor` reads the monitor in batches so that the flood never
  keeps the service from its clock (:mod:`.connections` decides what to drop);
- the listen backlog: libzmq listens with a backlog of 100 unless ``ZMQ_BACKLOG`` says otherwise,
  so when thousands of workers connect at once the kernel drops the surplus SYNs and those workers
  connect again only after TCP's retransmission timeout (1 s, then 3 s, 7 s, ...).
  :func:`configure_router` sizes the backlog to the run before the socket binds; the kernel caps
  it at ``net.core.somaxconn`` (:func:`backlog_note` says when that cap is lower than the run).

Nothing here logs: the functions return the lines, and the service says them.
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from epochal.nofile import read_int

FILES_RESERVED = 64
"""Descriptors the coordinator holds besides one per worker: ZeroMQ's own (its I/O thread's
poller and mailboxes), the journal, the standard streams, the CURVE authenticator's sockets."""

MIN_BACKLOG = 128
"""Listen backlog never set lower than this (libzmq's default is 100)."""

SOMAXCONN_PATH = Path("/proc/sys/net/core/somaxconn")

TOO_MANY_FILES = (errno.EMFILE, errno.ENFILE)


def files_needed(workers: int) -> int:
    """File descriptors a coordinator of ``workers`` workers needs, with room for its own."""
    return workers + FILES_RESERVED


def nofile_note(workers: int) -> str | None:
    """A warning when the soft limit (after raising it) is below what ``workers`` need, or None."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    needed = files_needed(workers)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return (
        f"warning: this coordinator may open at most {soft} files (the hard limit of "
        f"RLIMIT_NOFILE is {_limit(hard)}), but {workers} workers need about {needed}: only "
        f"about {max(soft - FILES_RESERVED, 0)} can connect. {_how_to_raise(needed)}"
    )


def backlog_for(workers: int) -> int:
    """The listen backlog for a run of ``workers``: every worker may connect in the same instant."""
    return max(MIN_BACKLOG, workers)


def configure_router(sock: zmq.Socket[Any], expected_workers: int) -> int:
    """Set the ROUTER's listen backlog for ``expected_workers``; return it. Call before bind."""
    backlog = backlog_for(expected_workers)
    sock.setsockopt(zmq.BACKLOG, backlog)
    return backlog


def backlog_note(expected_workers: int, somaxconn: int | None = None) -> str | None:
    """A note when the kernel caps the listen backlog below ``expected_workers``, or None.

    ``somaxconn`` defaults to ``/proc/sys/net/core/somaxconn`` (None where it cannot be read:
    then nothing is said).
    """
    cap = somaxconn if somaxconn is not None else read_int(SOMAXCONN_PATH)
    if cap is None or cap >= backlog_for(expected_workers):
        return None
    return (
        f"note: the kernel caps the listen backlog at {cap} (net.core.somaxconn), below the "
        f"{expected_workers} workers of this run: when they connect at once, those beyond it "
        "connect again only after TCP's retransmission timeout (1 s, 3 s, ...), which slows "
        f"the rendezvous; raise it with `sysctl -w net.core.somaxconn={expected_workers}`"
    )


def too_many_files_message(workers: int | None = None) -> str:
    """The line for a connection refused (or a file not opened) for want of file descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = "" if workers is None else f" and {workers} workers need about {files_needed(workers)}"
    return (
        f"too many open files: the soft limit is {_limit(soft)} (RLIMIT_NOFILE; the hard limit "
        f"is {_limit(hard)}){need}. "
        + _how_to_raise(files_needed(workers) if workers is not None else None)
    )


def _how_to_raise(needed: int | None) -> str:
    value = str(needed) if needed is not None else "N"
    return (
        f"Raise it with `ulimit -n {value}` in the shell that starts the coordinator (above the "
        f"hard limit: `ulimit -Hn {value}` as root, LimitNOFILE={value} in a systemd unit, or "
        "`nofile` in /etc/security/limits.conf)"
    )


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def is_too_many_files(exc: BaseException) -> bool:
    """Whether ``exc`` is the process (EMFILE) or the system (ENFILE) out of file descriptors."""
    return isinstance(exc, OSError) and exc.errno in TOO_MANY_FILES


class AcceptFailures:
    """The ROUTER's failed accepts (socket-monitor events), counted, and named once per cause.

    libzmq retries a connection it could not accept at every turn of its I/O thread, so one
    connection beyond the limit makes a flood of ``EVENT_ACCEPT_FAILED``: :meth:`note` counts each
    and says whether it was for want of descriptors; :meth:`other_line` names each other cause
    once; :meth:`rendezvous_note` is what a rendezvous timeout adds, so that it names the limit
    instead of "missing workers". The line for a shortage of descriptors depends on who holds
    them: :func:`files_shortage_message`.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.total = 0
        self.too_many_files = 0
        self._said: set[int] = set()

    def note(self, value: int) -> bool:
        """Count one failed accept with errno ``value``; whether it was for want of descriptors."""
        self.total += 1
        if value in TOO_MANY_FILES:
            self.too_many_files += 1
            return True
        return False

    def other_line(self, value: int) -> str | None:
        """The line for an accept that failed with errno ``value`` (not for want of descriptors),
        the first time that cause is seen; None after that."""
        if value in self._said:
            return None
        self._said.add(value)
        name = errno.errorcode.get(value, str(value))
        return f"cannot accept a connection: {name} ({os.strerror(value)})"

    def rendezvous_note(self, held: int = 0) -> str:
        """What a rendezvous timeout adds when connections could not be accepted: the cause.
        ``held``: connections of peers that had not joined when descriptors ran out; the advice
        to raise the limit is given only when the workers need more than it."""
        if self.too_many_files:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            needed = files_needed(self.workers)
            strangers = (
                f"; {held} of them were held by peers that had not joined the run" if held else ""
            )
            short = soft != resource.RLIM_INFINITY and soft < needed
            return (
                f"; the coordinator could not accept connections {self.too_many_files} times for "
                f"want of file descriptors (soft limit {_limit(soft)}{strangers}): the missing "
                "workers are probably waiting to connect, not missing"
                + (f". {_how_to_raise(needed)}" if short or not held else "")
            )
        if self.total:
            return f"; {self.total} connections could not be accepted (see the log above)"
        return ""


def files_shortage_message(workers: int, *, held: int) -> str:
    """The line for a connection not accepted for want of descriptors, naming who holds them:
    ``held`` connections of peers that have not joined the run, or the ``workers`` themselves.

    The advice to raise the limit for the workers is given only when they need more than it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = files_needed(workers)
    workers_fit = soft == resource.RLIM_INFINITY or soft >= needed
    head = (
        f"cannot accept a connection: too many open files (the open-files limit is {_limit(soft)}, "
        f"RLIMIT_NOFILE; the hard limit is {_limit(hard)})"
    )
    if held and workers_fit:
        return (
            f"{head}: {held} connections are held by peers that have not joined the run (the "
            f"{workers} workers need about {needed}); the oldest of them are dropped to make room"
        )
    if held:
        return (
            f"{head}: {held} connections are held by peers that have not joined the run, and the "
            f"{workers} workers need about {needed} by themselves. {_how_to_raise(needed)}"
        )
    if not workers_fit:
        return (
            f"{head} and {workers} workers need about {needed}. {_how_to_raise(needed)}; a worker "
            "waits in the listen queue until a descriptor is free"
        )
    return (
        f"{head}, though the {workers} workers need about {needed} and no peer that has not "
        "joined holds one: this process holds its descriptors elsewhere (see /proc/PID/fd). "
        + _how_to_raise(None)
    )


MONITOR_EVENT = struct.Struct("=Hi")
"""The first frame of a libzmq monitor event: its type, then its value (no padding). Read here
rather than by pyzmq's ``parse_monitor_message``, which makes two enum members of each event (a
flag enum's member for a value it does not list costs tens of microseconds): one event per
connection accepted and one per connection closed, thousands in a large rendezvous."""

MONITOR_BATCH = 256
"""Monitor events handled in one turn of the event loop before the monitor task yields."""


class AcceptMonitor:
    """A ROUTER's socket monitor, read in bounded batches.

    :meth:`watch` before the socket binds; :meth:`read` as a task for as long as the socket lives;
    :meth:`close` before the socket closes. The task drains the monitor until cancelled; and since
    an accept that fails for want of descriptors fails again at every turn of libzmq's I/O thread,
    events can come without end: the task yields to the event loop after every
    :data:`MONITOR_BATCH` events, so the service's clock, heartbeats and timeouts keep running.
    """

    def __init__(self) -> None:
        self._monitor: zmq.asyncio.Socket | None = None

    @property
    def watching(self) -> bool:
        return self._monitor is not None

    def watch(self, sock: zmq.asyncio.Socket, events: int) -> None:
        """Monitor ``sock``'s ``events`` through a pipe without a high-water mark: libzmq's I/O
        thread sends each event holding the socket's monitor lock and waits for room in a full
        pipe, so with a bounded pipe it waited whenever the reader fell behind (thousands of
        connections closing as a large run ends), and disabling the monitor, which takes that
        lock holding the interpreter's, then waited forever. An event is a few dozen bytes, one
        per connection accepted or closed."""
        address = f"inproc://epochal-monitor-{id(self):x}-{sock.FD}"
        sock.monitor(address, events)
        monitor = sock.context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.RCVHWM, 0)  # inproc: the pipe's bound is its reader's, none
        monitor.connect(address)
        self._monitor = monitor

    def close(self, sock: zmq.asyncio.Socket) -> None:
        """Stop monitoring ``sock`` (before it closes)."""
        if self._monitor is not None:
            sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    async def read(self, handle: Callable[[int, int], None]) -> None:
        """Hand every event (its type and value: a descriptor, or an errno) to ``handle``, at
        most :data:`MONITOR_BATCH` a turn."""
        monitor = self._monitor
        assert monitor is not None
        events: zmq.Socket[Any] = zmq.Socket.shadow(monitor.underlying)  # reads that never wait
        while True:
            await monitor.poll()
            for _ in range(MONITOR_BATCH):
                try:
                    frames = events.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2 and len(frames[0]) == MONITOR_EVENT.size:  # as libzmq sends
                    handle(*MONITOR_EVENT.unpack(frames[0]))
            await asyncio.sleep(0)  # an awaited poll that is already ready does not yield
