"""The ROUTER's connections, one per descriptor: whose they are, and which to drop.

libzmq's ROUTER accepts every TCP connection and keeps it until the peer leaves; it has no limit on
connections that never speak and no way to drop one peer. Each costs a file descriptor, libzmq's
buffers, and the frame it is still receiving (up to ``ZMQ_MAXMSGSIZE``; :data:`CONNECTION_BYTES`
has the measured cost), so strangers who connect and say nothing, or send all of a frame but its
last byte, could otherwise take every descriptor or any amount of memory. The rules here bound them:

- a connection that has not shown itself a member's within ``timeout`` (the heartbeat timeout: the
  silence after which a member is lost) is dropped;
- at most ``cap`` such connections are held at once: the oldest is dropped for each one past it.
  The oldest, because it has had the longest to say hello and has not, while the newest has had no
  chance yet; dropping the newest instead would let a peer that holds the cap shut every worker
  out;
- when an accept fails for want of descriptors, the oldest such connection is dropped to make room,
  one at a time (the next only once the last one is closed);
- a member's connection is never dropped for its age or their number;
- any connection, a member's too, that holds more of a message it has not finished than a legal
  peer ever sends is dropped (:mod:`.holding`: libzmq bounds a frame, not a message).

"Shown itself a member's" means a frame came on it that the run acted on as a member's (an
admitted hello, or a frame carrying the member's session). The socket monitor names each
connection's descriptor as it is accepted and closed (``EVENT_ACCEPTED``, ``EVENT_DISCONNECTED``),
and every frame names the descriptor it came on (``ZMQ_SRCFD``): :class:`Connections` keeps the
table and decides, with the clock as an argument; :class:`~.guard.ConnectionGuard` feeds it and
carries out its drops with :func:`~.guard.shut`, which shuts a connection down through a duplicate
of its descriptor once the duplicate is checked to be the same socket (made in a slot kept for it:
out of descriptors is when a drop is needed most). libzmq's I/O thread then reads end of file,
closes the connection as if the peer had left, and says so (``EVENT_DISCONNECTED``); nothing there
closes a descriptor libzmq owns. The monitor loses no event (libzmq's I/O thread waits for room
in the monitor's pipe), so the table follows libzmq's own.

What libzmq offers and why it is not enough alone: ``ZMQ_HANDSHAKE_IVL`` (set to the same
timeout, 2 ms more: libzmq's timers count whole milliseconds from a cached clock, so one may
fire up to a millisecond early) closes connections that never finish ZeroMQ's handshake, not
those that finish it and then say nothing or hold a frame; ZMTP heartbeats
(``ZMQ_HEARTBEAT_TIMEOUT``) would close a peer that holds a frame (it cannot answer mid-frame),
but not a ZeroMQ socket that answers them and says nothing, and they would close a member's
connection whenever its process is stopped, which is the watchdog's to judge;
``ZMQ_ROUTER_NOTIFY`` tells of a connection but gives no way to close it; a frame's
``Peer-Address`` names a host, not a connection.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from epochal.coordinator.rules.holding import Held
from epochal.coordinator.serve.oslimits import AcceptFailures, files_needed, files_shortage_message

UNADMITTED_BYTES = 128 * 1024 * 1024
"""Memory the connections that have not joined may hold in all (when the run is small enough that
its own workers' connections do not need more)."""

CONNECTION_BYTES = 64 * 1024
"""Memory per connection held besides the frame it receives: libzmq's own (decoder and encoder
buffers, the session, the pipes; 22-32 KiB measured with 1,000-1,365 connections held) and, as
the oldest are dropped for new ones, the connections shut down but not yet closed and the heap
their frames leave scattered. Measured: 2,000 connections each holding all but a byte of a
64 KiB frame, reopened as soon as closed, peaked at 108-125 KiB per connection of the cap."""

HANDSHAKE_MARGIN_MS = 2
"""Milliseconds ``ZMQ_HANDSHAKE_IVL`` adds to the timeout: libzmq's timers read a clock truncated
to the millisecond and cached, so one set to the timeout alone may fire up to 1 ms before it."""

Why = Literal["timeout", "cap", "files", "holding"]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How long and how many connections that have not joined are held."""

    timeout: float
    # seconds a connection may stay open without a member's frame on it
    cap: int
    # connections that have not joined held at once
    by_memory: int
    # the cap that keeps them within UNADMITTED_BYTES at frame_bytes each
    by_files: int | None
    # the cap that leaves the workers their descriptors; None: the open-files limit is unlimited
    workers: int
    frame_bytes: int
    files: int | None
    # the soft open-files limit; None: unlimited

    def describe(self) -> str:
        """Where the cap comes from, for the line said when it is first reached."""
        memory = (
            f"{self.by_memory} connections of up to {_size(self.frame_bytes + CONNECTION_BYTES)} "
            f"hold {_size(self.by_memory * (self.frame_bytes + CONNECTION_BYTES))}"
        )
        if self.by_files is None:
            files = "the open-files limit is unlimited"
        else:
            files = (
                f"the open-files limit ({self.files}) leaves {max(self.by_files, 0)} besides the "
                f"{files_needed(self.workers)} of the {self.workers} workers and the coordinator"
            )
        return f"{memory}; {files}; never fewer than the {self.workers} workers"


def connection_limits(
    *, workers: int, timeout: float, frame_bytes: int, files: int | None
) -> ConnectionLimits:
    """The limits for a run of ``workers`` whose frames are at most ``frame_bytes``, under a soft
    open-files limit of ``files`` (None: unlimited).

    The cap is the smaller of what keeps strangers within :data:`UNADMITTED_BYTES` and what leaves
    the workers their descriptors, but never below the number of workers: every one of them may
    connect in the same instant (at a rendezvous, or when they re-attach), and each is a stranger
    until its hello is read.
    """
    by_memory = max(1, UNADMITTED_BYTES // (frame_bytes + CONNECTION_BYTES))
    by_files = None if files is None else files - files_needed(workers)
    cap = max(workers, min(by_memory, by_files if by_files is not None else by_memory))
    return ConnectionLimits(
        timeout=timeout,
        cap=cap,
        by_memory=by_memory,
        by_files=by_files,
        workers=workers,
        frame_bytes=frame_bytes,
        files=files,
    )


def _size(n: int) -> str:
    if n >= 1024 * 1024:
        return f"{n / (1024 * 1024):.0f} MiB"
    return f"{math.ceil(n / 1024)} KiB"


@dataclass(frozen=True, slots=True)
class Drop:
    """Shut this connection down: ``fd`` while it is still the socket ``inode``."""

    fd: int
    inode: int
    why: Why


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one event leads to: connections to drop, lines to log."""

    drops: tuple[Drop, ...] = ()
    lines: tuple[str, ...] = ()


NOTHING = Verdict()


@dataclass(slots=True)
class _Pending:
    since: float
    inode: int


class Connections:
    """The ROUTER's open connections by descriptor, and the drops that bound them.

    Feed it the socket monitor's events (:meth:`accepted`, :meth:`closed`, :meth:`accept_failed`),
    the descriptor of every frame the run acted on as a member's (:meth:`admitted`), and the clock
    (:meth:`expired`, :meth:`forgive`); carry out the :class:`Drop` of each :class:`Verdict`, and
    call :meth:`gone` for a drop whose descriptor turned out to be another socket already.
    """

    def __init__(self, limits: ConnectionLimits, failures: AcceptFailures) -> None:
        self.limits = limits
        self.failures = failures
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        # connections not known to be a member's, the longest open first
        self._members: dict[int, int] = {}
        # connections a member's frame came on: descriptor -> socket inode
        self._dropping: dict[int, float] = {}
        # descriptors shut down, until libzmq says it closed them (or a timeout passed); in the
        # order they were shut down
        self._capped = False
        self._short_said = False
        self._held_short = 0
        # connections of peers that had not joined when descriptors last ran out
        self._holding_said = False
        self.dropped: dict[Why, int] = {"timeout": 0, "cap": 0, "files": 0, "holding": 0}

    @property
    def pending(self) -> int:
        """Connections open that have not shown themselves a member's."""
        return len(self._pending)

    @property
    def held(self) -> int:
        """Connections held by peers that have not joined: pending, or shut and not yet closed."""
        return len(self._pending) + len(self._dropping)

    def knows(self, fd: int) -> bool:
        """Whether a member's frame came on ``fd`` already."""
        return fd in self._members

    def strangers(self) -> list[int]:
        """The descriptors of the connections open that have not shown themselves a member's."""
        return list(self._pending)

    def everyone(self) -> list[int]:
        """The descriptors of every connection open and not being dropped."""
        return [*self._pending, *self._members]

    # ------------------------------------------------------------------ the monitor's events

    def accepted(self, now: float, fd: int, inode: int | None) -> Verdict:
        """libzmq accepted a connection on ``fd`` (the socket ``inode``; None: already closed)."""
        if inode is not None and self._members.get(fd) == inode:
            return NOTHING  # a member's frame on it was read before this event
        self._forget(fd)  # a descriptor number libzmq closed and reused
        if inode is None:
            return NOTHING
        self._pending[fd] = _Pending(now, inode)
        if len(self._pending) <= self.limits.cap:
            return NOTHING
        drops = [self._drop_oldest(now, "cap")]
        lines: tuple[str, ...] = ()
        if not self._capped:
            self._capped = True
            if self._by_files():
                self._short_said = True  # the same shortage as a failed accept: said once
            lines = (
                f"more than {self.limits.cap} connections are open from peers that have not "
                "joined the run: the oldest of them is dropped for each new one (a worker's "
                f"connection never is, once its hello is in). The cap: {self.limits.describe()}",
            )
        return Verdict(tuple(drops), lines)

    def closed(self, fd: int) -> None:
        """libzmq closed the connection on ``fd``."""
        self._forget(fd)

    def accept_failed(self, now: float, errno_value: int) -> Verdict:
        """An accept failed with ``errno_value``. Out of descriptors: say so once, naming who
        holds them, and make room by dropping the oldest connection that has not joined, unless
        one is still being closed (libzmq retries the accept at once, so the failures come in
        floods: one drop per descriptor needed, not one per failure)."""
        if not self.failures.note(errno_value):
            line = self.failures.other_line(errno_value)
            return NOTHING if line is None else Verdict(lines=(line,))
        self._held_short = self.held
        lines: tuple[str, ...] = ()
        if not self._short_said:
            self._short_said = True
            lines = (files_shortage_message(self.limits.workers, held=self.held),)
        if self._dropping or not self._pending:
            return Verdict(lines=lines) if lines else NOTHING
        return Verdict((self._drop_oldest(now, "files"),), lines)

    # ------------------------------------------------------------------ frames and the clock

    def admitted(self, fd: int, inode: int) -> None:
        """A frame the run acted on as a member's came on ``fd`` (the socket ``inode``): never
        drop that connection, even when the monitor says it was accepted only later."""
        self._members[fd] = inode
        self._pending.pop(fd, None)

    def expired(self, now: float) -> Verdict:
        """The connections open ``timeout`` seconds without a member's frame: drop them. Forget
        drops libzmq never confirmed within that time (their descriptor is closed anyway)."""
        timeout = self.limits.timeout
        drops: list[Drop] = []
        while self._pending:
            fd, entry = next(iter(self._pending.items()))
            if now - entry.since < timeout:
                break
            drops.append(self._drop_oldest(now, "timeout"))
        while self._dropping:
            fd, since = next(iter(self._dropping.items()))
            if now - since < timeout:
                break
            del self._dropping[fd]
        return Verdict(tuple(drops)) if drops else NOTHING

    def holding(self, now: float, held: Iterable[Held], limit: int) -> Verdict:
        """Connections that hold more than ``limit`` bytes of a message they have not finished:
        drop them, a member's too (no worker sends such a message), and say so the first time."""
        drops: list[Drop] = []
        most = 0
        for entry in held:
            fd = entry.fd
            inode = self._members.pop(fd, None)
            if inode is None:
                pending = self._pending.pop(fd, None)
                if pending is None:  # being dropped already, or not known yet
                    continue
                inode = pending.inode
            self._dropping[fd] = now
            self.dropped["holding"] += 1
            drops.append(Drop(fd, inode, "holding"))
            most = max(most, entry.held)
        if not drops:
            return NOTHING
        lines: tuple[str, ...] = ()
        if not self._holding_said:
            self._holding_said = True
            lines = (
                f"a connection held {_size(most)} of a message it had not finished, more than a "
                f"worker ever sends (one frame of at most {_size(self.limits.frame_bytes)}): it "
                f"is dropped, as is every connection that holds more than {_size(limit)}",
            )
        return Verdict(tuple(drops), lines)

    def forgive(self, lost: float) -> None:
        """The service was not running for ``lost`` seconds: nobody's time ran meanwhile."""
        for entry in self._pending.values():
            entry.since += lost
        for fd in self._dropping:
            self._dropping[fd] += lost

    def gone(self, fd: int) -> None:
        """A drop found ``fd`` no longer the socket it was: that connection is closed already."""
        self._dropping.pop(fd, None)

    # ------------------------------------------------------------------ inside

    def _drop_oldest(self, now: float, why: Why) -> Drop:
        fd, entry = self._pending.popitem(last=False)
        self._dropping[fd] = now
        self.dropped[why] += 1
        return Drop(fd, entry.inode, why)

    def _forget(self, fd: int) -> None:
        self._pending.pop(fd, None)
        self._members.pop(fd, None)
        self._dropping.pop(fd, None)

    def _by_files(self) -> bool:
        limits = self.limits
        return limits.by_files is not None and limits.cap == max(limits.by_files, limits.workers)

    def rendezvous_note(self) -> str:
        """What a rendezvous timeout adds about accepts that failed, and who held the
        descriptors then."""
        return self.failures.rendezvous_note(held=self._held_short)

    def summary(self) -> str | None:
        """The line that counts the connections dropped, said as the run ends; None if none."""
        counts = self.dropped
        if not any(counts.values()):
            return None
        return (
            f"dropped {counts['timeout']} connections that did not join within "
            f"{self.limits.timeout:g} s, {counts['cap']} past the cap of {self.limits.cap}, "
            f"{counts['files']} to free descriptors and {counts['holding']} that held an "
            "unfinished message"
        )
