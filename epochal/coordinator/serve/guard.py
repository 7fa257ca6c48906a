"""The socket work around :class:`~.connections.Connections`: the monitor's events and the
members' frames in, the drops carried out on the connections' descriptors, the lines logged.

:mod:`.connections` decides which connection to drop, with the clock as an argument; here are the
descriptors: :func:`shut` shuts a connection down through a checked duplicate of its descriptor
(libzmq then reads end of file and closes it as if the peer had left), and
:class:`ConnectionGuard` is what the service and the router call.
"""

from __future__ import annotations

import math
import os
import resource
import socket
import stat
import struct
import time
from collections.abc import Callable
from typing import Any

import zmq

from epochal.coordinator.rules.holding import (
    GiveBack,
    Holdings,
    HoldLimits,
    MemoryWatch,
    wire_bytes,
)
from epochal.coordinator.serve import kernel
from epochal.coordinator.serve.connections import HANDSHAKE_MARGIN_MS, Connections, Drop, Verdict
from epochal.coordinator.serve.inbox import Received


def inode_of(fd: int) -> int | None:
    """The inode of the socket open on ``fd`` (unique while it is open), or None: not a socket."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_ino if stat.S_ISSOCK(info.st_mode) else None


class Scratch:
    """Two descriptors of this process's own, so that a connection can be shut down when no
    descriptor is left to open (which is when it matters most): ``slot`` takes a duplicate of the
    connection's descriptor in place (``dup2``), ``null`` (``/dev/null``) takes it back."""

    def __init__(self) -> None:
        self.null = os.open(os.devnull, os.O_RDONLY)  # not inherited (PEP 446)
        self.slot = os.dup(self.null)

    def close(self) -> None:
        os.close(self.slot)
        os.close(self.null)


NO_LINGER = struct.pack("ii", 1, 0)
"""``struct linger`` on, for 0 seconds: a close resets the connection."""


def shut(drop: Drop, port: int | None, scratch: Scratch) -> bool:
    """Shut down the connection of ``drop``; False when its descriptor is no longer that socket.

    The check and the shutdown act on a duplicate of the descriptor (in ``scratch``'s slot: no new
    descriptor is needed), so a descriptor libzmq closes and reuses meanwhile cannot turn the
    shutdown onto another socket; ``port`` (the ROUTER's, None for other transports) is checked
    too. libzmq's own descriptor is left to libzmq, which reads end of file and closes the
    connection.

    The connection lingers not (``SO_LINGER`` 0, an option of the socket, so libzmq's descriptor
    has it too): libzmq's close then resets it. Else a peer that was sending when it was shut
    down waits on a closed window until the orphan the kernel keeps in FIN-WAIT-2 times out (60 s,
    seen with a peer sending a message that never ends), and those buffers stay held meanwhile.
    """
    try:
        os.dup2(drop.fd, scratch.slot, inheritable=False)
    except OSError:  # closed already
        return False
    try:
        if inode_of(scratch.slot) != drop.inode:
            return False
        sock = socket.socket(fileno=scratch.slot)
        try:
            inet = sock.family in (socket.AF_INET, socket.AF_INET6)
            if port is not None and inet and sock.getsockname()[1] != port:
                return False
            if inet:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, NO_LINGER)
            sock.shutdown(socket.SHUT_RDWR)
            return True
        finally:
            sock.detach()  # the slot stays open: it is given back to /dev/null below
    except OSError:  # ENOTCONN: the peer is gone already
        return False
    finally:
        os.dup2(scratch.null, scratch.slot, inheritable=False)


LOOK_SHARE = 0.1
"""The most of the service's time that looking at what libzmq holds of the strangers' connections
may take: a look at 4,096 connections takes about 16 ms, so at that many the next comes 0.14 s
later, while a few connections are looked at every turn."""

EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_DISCONNECTED
"""The monitor events :class:`ConnectionGuard` reads."""


def open_files() -> int | None:
    """The soft open-files limit of this process; None: unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _port(endpoint: str) -> int | None:
    if not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


class ConnectionGuard:
    """The socket work around :class:`Connections`: the monitor's events and the members' frames
    in, the drops carried out, the lines logged.

    :meth:`configure` the ROUTER before it binds (libzmq itself then closes a connection whose
    ZMTP handshake is not done within the timeout) and :meth:`bound` after; :meth:`on_event` for
    every event of a monitor watching :data:`EVENTS`; :meth:`unknown` for every frame, and
    :meth:`admit` when that frame, from a connection not yet known, was a member's; :meth:`handed`
    for every message received; :meth:`tick` every turn of the service; :meth:`close` after the
    socket.

    Each turn it looks at what libzmq holds of the strangers' connections, and of every connection
    once this process's memory grew by :data:`~.holding.MEMORY_STEP` since it last did; it hands
    freed memory back to the system after connections have closed.
    """

    def __init__(
        self,
        connections: Connections,
        log: Callable[[str], None],
        on_member_closed: Callable[[bytes], None] = lambda peer: None,
        *,
        holding: HoldLimits,
        secured: bool = False,
    ) -> None:
        self.connections = connections
        self._log = log
        self._on_member_closed = on_member_closed
        self._members: dict[int, bytes] = {}
        # a member's connection's descriptor -> its routing id, to tell when it closes
        self._port: int | None = None
        self._scratch: Scratch | None = None
        self._secured = secured
        # CURVE on every connection: each frame took CURVE_BYTES more on the wire
        self.holdings = Holdings(holding)
        self._watch = MemoryWatch()
        self._give_back = GiveBack()
        self._resident: kernel.Resident | None = None
        self._next_look = 0.0
        # when the strangers' connections are looked at next (monotonic seconds)

    def close(self) -> None:
        """Close the guard's own descriptors (once the socket is closed)."""
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None
        if self._resident is not None:
            self._resident.close()
            self._resident = None

    def configure(self, sock: zmq.Socket[Any]) -> None:
        # never before the timeout: libzmq truncates its clock to the millisecond
        ivl = math.ceil(self.connections.limits.timeout * 1000) + HANDSHAKE_MARGIN_MS
        sock.setsockopt(zmq.HANDSHAKE_IVL, ivl)

    def bound(self, endpoint: str) -> None:
        """The ROUTER listens on ``endpoint``: a drop checks its descriptor is on that port.
        From now on the guard holds two descriptors of its own, until :meth:`close`."""
        self._port = _port(endpoint)
        self._scratch = Scratch()
        self._resident = kernel.Resident()

    def on_event(self, event: int, value: int) -> None:
        connections, now = self.connections, time.monotonic()
        if event & zmq.EVENT_DISCONNECTED:
            connections.closed(value)
            self.holdings.closed(value)
            self._give_back.freed()
            peer = self._members.pop(value, None)
            if peer is not None:
                self._on_member_closed(peer)
        elif event & zmq.EVENT_ACCEPTED:
            self._carry_out(connections.accepted(now, value, inode_of(value)))
        elif event & zmq.EVENT_ACCEPT_FAILED:
            self._carry_out(connections.accept_failed(now, value))

    def unknown(self, frame: Any) -> int | None:
        """The descriptor ``frame`` (a zmq.Frame) came on, if no member's frame came on it yet;
        else None. Costs a lookup: the caller checks the frame is a member's only when new."""
        if not isinstance(frame, (zmq.Frame, Received)):
            return None
        fd = frame.get(zmq.SRCFD)
        return None if fd < 0 or self.connections.knows(fd) else fd

    def admit(self, fd: int, peer: bytes) -> None:
        """A frame of member ``peer`` came on ``fd``: its connection is never dropped, and its
        closing is told (``on_member_closed``)."""
        self._members[fd] = peer
        inode = inode_of(fd)
        if inode is not None:
            self.connections.admitted(fd, inode)

    def handed(self, frames: list[Any]) -> None:
        """The service was handed ``frames`` (a zmq.Frame each: routing id, then what the peer
        sent): count their bytes against the connection they came on."""
        holdings, secured = self.holdings, self._secured
        for frame in frames[1:]:  # the routing id is the ROUTER's, not the peer's
            if isinstance(frame, zmq.Frame):
                holdings.handed(frame.get(zmq.SRCFD), wire_bytes(len(frame), secured))

    def tick(self, now: float, drained: bool = True) -> None:
        """A turn of the service at ``now``; ``drained``: it had just read every message queued."""
        connections = self.connections
        self._carry_out(connections.expired(now))
        resident = None if self._resident is None else self._resident.bytes()
        if self._watch.due(resident):
            fds = connections.everyone()
        elif now >= self._next_look:
            fds = connections.strangers()
        else:
            fds = []
        if fds:
            started = time.perf_counter()
            readings = [(fd, read) for fd in fds if (read := kernel.bytes_read(fd)) is not None]
            # a look at thousands of connections (a rendezvous: every worker a stranger until its
            # hello is read) takes milliseconds: the strangers are looked at again once the
            # service has done LOOK_SHARE's complement of other work, a few at every turn
            took = time.perf_counter() - started
            self._next_look = now + took * (1 - LOOK_SHARE) / LOOK_SHARE
            over = self.holdings.over(readings, drained=drained)
            if over:
                limits = self.holdings.limits
                limit = limits.drained if drained else limits.queued
                self._carry_out(connections.holding(now, over, limit))
        if self._give_back.due(now):
            kernel.give_back_memory()

    def forgive(self, lost: float) -> None:
        self.connections.forgive(lost)

    def summary(self) -> str | None:
        return self.connections.summary()

    def rendezvous_note(self) -> str:
        return self.connections.rendezvous_note()

    def _carry_out(self, verdict: Verdict) -> None:
        for line in verdict.lines:
            self._log(line)
        scratch = self._scratch
        assert scratch is not None or not verdict.drops, "bound() first"
        for drop in verdict.drops:
            if scratch is None or not shut(drop, self._port, scratch):
                self.connections.gone(drop.fd)
