"""Unfinished messages: how much of one libzmq holds for each connection, and when that is too much.

libzmq bounds a frame (``ZMQ_MAXMSGSIZE``) and the finished messages queued per peer
(``ZMQ_RCVHWM``), not a message: its pipes keep the frames of a multipart message out of sight,
of the application and of the high-water mark alike, until the last one. So a peer that sends
frames flagged "more" without end is held in memory without limit (measured: one connection took
a coordinator to 1,024 MiB in 4 s, and nothing closed it). No legal peer sends such a message:
every message a worker sends is one frame of at most ``MAX_FRAME_BYTES``.

What libzmq holds of one connection is what its I/O thread read off the socket (the kernel counts
it: :func:`~.kernel.bytes_read`) less what the service was handed from that connection: every
frame names the descriptor it came on (``ZMQ_SRCFD``), and its bytes on the wire are its size
and its framing (:func:`wire_bytes`, exact for ZMTP 3), all less the handshake. :class:`Holdings`
keeps the count of what was handed, and says which connections hold more than
:class:`HoldLimits` allow: the connection guard drops those (any peer's, a member's too), and
:class:`MemoryWatch` and :class:`GiveBack` say when to look at every connection and when to hand
freed memory back. Pure: the clock and the counts are arguments.

The bound is on bytes, and libzmq's memory for them depends on the frames' sizes: a frame is a
64-byte ``zmq_msg_t`` in its pipe, plus its bytes when longer than 33. So a message of empty
frames costs up to 32 times its bytes (measured: 16 MiB of empty frames, 514 MiB resident; of
64 KiB frames, 16 MiB).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from epochal.protocol.limits import MAX_FRAME_BYTES

LONG_HEAD_BYTES = 9
"""A long frame's flags and size on the wire (ZMTP 3); a short one (at most 255 bytes) has 2."""

CURVE_BYTES = 33
"""What CURVE adds to a frame's bytes on the wire: its ``MESSAGE`` command name and nonce (16),
the box's MAC (16) and the frame's flags, which travel inside the box (1)."""

HANDSHAKE_BYTES = 4096
"""What a connection may send before its first message besides its messages' bytes: ZMTP's
64-byte greeting and the mechanism's commands (``READY``; under CURVE ``HELLO`` of 200 bytes and
``INITIATE`` with the metadata). A libzmq DEALER with the longest routing id (255 bytes) sends 369
of them, 822 under CURVE (``tests/coordinator/test_holding.py`` checks it on real sockets); a peer
that sends more only counts it against what it may hold."""

MEMORY_STEP = 16 * 1024 * 1024
"""Growth of this process's resident memory, since every connection was last looked at, after
which every connection is looked at again (the strangers' are at every turn of the service)."""

GIVE_BACK_INTERVAL = 1.0
"""Seconds between two hand-backs of freed memory to the system (each costs a few ms)."""


def wire_bytes(size: int, secured: bool) -> int:
    """The bytes a frame of ``size`` bytes took on the wire (ZMTP 3), under CURVE if
    ``secured``."""
    body = size + (CURVE_BYTES if secured else 0)
    return body + (2 if body <= 255 else LONG_HEAD_BYTES)


def largest_message(secured: bool) -> int:
    """The bytes on the wire of the largest message a legal peer sends: one frame of
    ``MAX_FRAME_BYTES``."""
    return wire_bytes(MAX_FRAME_BYTES, secured)


@dataclass(frozen=True, slots=True)
class HoldLimits:
    """The most bytes of a connection libzmq may hold before it is dropped: ``drained`` when the
    service had just read every finished message, ``queued`` when it had not."""

    drained: int
    # the handshake, one frame being received, and one message finished since the last read
    queued: int
    # the same, plus the finished messages libzmq may queue for the peer (ZMQ_RCVHWM)


def hold_limits(receive_hwm: int, secured: bool) -> HoldLimits:
    """The limits for a socket that queues ``receive_hwm`` messages per peer, under CURVE if
    ``secured``.

    A legal peer's bytes that the service has not been handed are its handshake, the frame libzmq
    is receiving (at most one largest message), and the messages finished since the service last
    found none left to read: one, when the service has just read them all (a message the I/O
    thread finished between that read and the look); up to ``receive_hwm`` more when it had not.
    """
    largest = largest_message(secured)
    drained = HANDSHAKE_BYTES + 2 * largest
    return HoldLimits(drained=drained, queued=drained + receive_hwm * largest)


@dataclass(frozen=True, slots=True)
class Held:
    """Connection ``fd`` holds ``held`` bytes libzmq read and did not hand over."""

    fd: int
    held: int


class Holdings:
    """The bytes handed to the service from each connection, and which hold too much.

    Feed it every frame's descriptor and bytes on the wire (:meth:`handed`) and every closed
    connection (:meth:`closed`); :meth:`over` takes what libzmq read of each connection looked at
    and returns those past the limit.
    """

    def __init__(self, limits: HoldLimits) -> None:
        self.limits = limits
        self._handed: dict[int, int] = {}

    def handed(self, fd: int, nbytes: int) -> None:
        """A frame of ``nbytes`` on the wire, from the connection on ``fd``, was handed over."""
        self._handed[fd] = self._handed.get(fd, 0) + nbytes

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` closed: a new one there starts from nothing."""
        self._handed.pop(fd, None)

    def held(self, fd: int, read: int) -> int:
        """What libzmq holds of the connection on ``fd``, which it read ``read`` bytes of.

        More handed than read can only be frames of the descriptor's previous connection, read
        after it closed: the new connection gets no credit for them."""
        handed = self._handed.get(fd, 0)
        if handed > read:
            self._handed[fd] = handed = read
        return read - handed

    def over(self, readings: Iterable[tuple[int, int]], *, drained: bool) -> list[Held]:
        """Of ``readings`` (descriptor, bytes libzmq read of it), the connections that hold more
        than the limit: the ``drained`` one when the service had just read every finished
        message."""
        limit = self.limits.drained if drained else self.limits.queued
        out = []
        for fd, read in readings:
            held = self.held(fd, read)
            if held > limit:
                out.append(Held(fd, held))
        return out


class MemoryWatch:
    """When to look at every connection, not only the strangers': once this process's resident
    memory is ``step`` above where it was at the last such look (or its lowest since)."""

    def __init__(self, step: int = MEMORY_STEP) -> None:
        self.step = step
        self._mark: int | None = None

    def due(self, resident: int | None) -> bool:
        """Whether to look at every connection now, with ``resident`` bytes resident (None: not
        known, never)."""
        if resident is None:
            return False
        if self._mark is None or resident < self._mark:
            self._mark = resident
            return False
        if resident - self._mark < self.step:
            return False
        self._mark = resident
        return True


class GiveBack:
    """When to hand freed memory back to the system: after a connection has closed (libzmq freed
    what it held), at most once every ``interval`` seconds."""

    def __init__(self, interval: float = GIVE_BACK_INTERVAL) -> None:
        self.interval = interval
        self._owed = False
        self._last: float | None = None

    def freed(self) -> None:
        """A connection closed."""
        self._owed = True

    def due(self, now: float) -> bool:
        """Whether to hand memory back now (and, if so, it is counted as done)."""
        if not self._owed or (self._last is not None and now - self._last < self.interval):
            return False
        self._owed = False
        self._last = now
        return True
