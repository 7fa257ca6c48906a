"""Frames out of libzmq at once: the coordinator's queue of received frames, as compact copies.

libzmq reads each connection into batch buffers of its own (8 KiB of data plus the bookkeeping of
the frames cut from it, about 18 KiB in all) and keeps every received frame inside the buffer it
came in; a buffer is freed once every frame in it has been read, and a connection that reads again
while one of its frames is still queued takes a new buffer. A coordinator that decodes frames more
slowly than they come (every rank's loss report and Status of an epoch arrive within moments) left
frames queued on thousands of connections, a buffer or more pinned by each: at 4,096 workers most
of its RSS above the bare ROUTER's, and at 10,000 workers nearly a gigabyte.

So the service empties libzmq's queue as fast as it can read it: :meth:`Inbox.drain` takes every
queued frame out into a copy of its own bytes (:class:`Received`, with the descriptor it came on
and, under CURVE, its sender's key: what the intake asks of a frame), and the service hands them
on from here in the order they came. The inbox is bounded in frames and in bytes; past either
bound the frames wait in libzmq, whose receive high-water mark then holds each peer back, as it
did before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

USER_ID = "User-Id"
"""The metadata property of a frame that holds its sender's ZAP user id (under CURVE)."""


class Received:
    """A received frame copied out of libzmq: its bytes, and what :meth:`get` answers for it (the
    descriptor it came on, ``zmq.SRCFD``; its sender's ZAP user id, ``"User-Id"``).

    A plain object rather than a :class:`zmq.Frame`: a frame made from bytes asks libzmq for a
    message of its own, which cost more than the copy itself at thousands of frames an epoch."""

    __slots__ = ("bytes", "sender", "source")

    def __init__(self, data: bytes, source: int, sender: str | None) -> None:
        self.bytes = data
        self.source = source
        self.sender = sender

    def __len__(self) -> int:
        return len(self.bytes)

    @property
    def buffer(self) -> bytes:
        """The frame's bytes (a zmq.Frame's ``buffer``: read without a copy)."""
        return self.bytes

    def get(self, option: Any) -> Any:
        if option == zmq.SRCFD:
            return self.source
        if option == USER_ID:
            if self.sender is None:  # as libzmq answers for a connection without security
                raise zmq.ZMQError(zmq.EINVAL)
            return self.sender
        raise zmq.ZMQError(zmq.EINVAL)  # no other property is kept


def _sender(frame: zmq.Frame) -> str | None:
    try:
        return str(frame.get(USER_ID))
    except zmq.ZMQError:  # no security mechanism on this connection: no user id
        return None


class Inbox:
    """Received messages (routing id, frame), read out of ``socket`` by :meth:`drain` (each told
    to ``read`` as it leaves libzmq: the connection guard counts it as no longer held there) and
    handed on in order by :meth:`pop`. ``secured``: the socket runs CURVE, and each frame's sender
    is kept. At most ``most_frames`` messages and ``most_bytes`` bytes are held."""

    def __init__(
        self,
        socket: zmq.Socket[Any],
        *,
        read: Callable[[list[Any]], None],
        secured: bool,
        most_frames: int,
        most_bytes: int,
    ) -> None:
        self._socket = socket
        self._read = read
        self._secured = secured
        self._most_frames = most_frames
        self._most_bytes = most_bytes
        self._queue: deque[tuple[list[Any], int]] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self) -> bool:
        """Read every frame libzmq holds for the socket, up to the bounds, telling ``read`` of
        each message as it leaves libzmq; whether libzmq then holds no finished message."""
        socket, queue, secured = self._socket, self._queue, self._secured
        recv = socket.recv
        while len(queue) < self._most_frames and self._bytes < self._most_bytes:
            try:
                # the routing id as bytes, the peer's frame as a zmq.Frame (its descriptor and
                # sender are asked of it): a third of what reading both as frames costs
                peer = recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            # a routing id is always followed by a frame of the peer's, and a message arrives
            # whole: these never wait. A frame says whether another follows (``more``), which
            # costs a tenth of asking the socket (getsockopt) after each
            last = recv(zmq.NOBLOCK, copy=False)
            parts: list[Any] = [peer, last]
            while last.more:
                last = recv(zmq.NOBLOCK, copy=False)
                parts.append(last)
            self._read(parts)
            if len(parts) != 2:  # not a DEALER's message: the intake counts it and drops it
                queue.append(([b""] * len(parts), 0))
                continue
            frame = parts[1]
            data = frame.bytes
            size = len(data)
            received = Received(data, frame.get(zmq.SRCFD), _sender(frame) if secured else None)
            queue.append(([peer, received], size))
            self._bytes += size
        return False

    def pop(self) -> list[Any] | None:
        """The oldest message read and not handed on yet; None when there is none."""
        if not self._queue:
            return None
        frames, size = self._queue.popleft()
        self._bytes -= size
        return frames
