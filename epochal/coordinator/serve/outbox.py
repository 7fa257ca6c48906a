"""How the coordinator service sends: one frame to a peer, or one encoded message to many.

:class:`Outbox` owns the sending half of the service's ROUTER socket. It sends through a shadow of
the socket without asyncio's futures: a ROUTER's send to a peer never blocks (past its high-water
mark libzmq drops), and pyzmq's awaitable calls cost a future and loop bookkeeping each, about a
third of the service's CPU at 4,096 workers (``bench/``). It holds back an optional message type
from a worker whose hello did not say it understands it (the machine knows who understands what),
and says so once per type. A broadcast is encoded once for all its peers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from epochal.coordinator.serve import killpoints as faults
from epochal.protocol import TYPE_NAMES, CoordinatorMessage, encode


class Outbox:
    """The service's sends; see the module docstring. ``understands(peer, message)``: whether
    ``peer`` may be sent ``message`` (:meth:`.RunMachine.understands`); ``encode``: a message's
    frame (the service's encoder, which a test may make another minor version's)."""

    def __init__(
        self,
        understands: Callable[[bytes, CoordinatorMessage], bool],
        log: Callable[[str], None],
        *,
        encode: Callable[[CoordinatorMessage], bytes] = encode,
    ) -> None:
        self._understands = understands
        self._log = log
        self._encode = encode
        self._socket: zmq.asyncio.Socket | None = None
        self._io: zmq.Socket[Any] | None = None
        # the same socket without asyncio's futures, for the sends that never wait
        self._held_back: set[str] = set()
        # the optional message types held back from a worker that does not understand them

    def attach(self, sock: zmq.asyncio.Socket) -> zmq.Socket[Any]:
        """Send through ``sock`` from now on; return the shadow of it that never waits (the
        service reads through it too)."""
        self._socket = sock
        self._io = zmq.Socket.shadow(sock.underlying)
        return self._io

    def detach(self) -> None:
        """The socket is about to close (a shadow closes with it): nothing is sent after this."""
        self._socket = self._io = None

    def understood(self, peer: bytes, message: CoordinatorMessage) -> bool:
        """Whether ``peer`` may be sent ``message`` (an optional type only if its hello said it
        understands it); the first message of a type held back is said once."""
        if self._understands(peer, message):
            return True
        name = TYPE_NAMES[type(message)]
        if name not in self._held_back:
            self._held_back.add(name)
            self._log(
                f"a worker of an older version does not understand {name} messages: none is "
                "sent to it (said once)"
            )
        return False

    async def send(self, peer: bytes, message: CoordinatorMessage) -> None:
        """``message`` to ``peer``, unless it would not understand it."""
        if self.understood(peer, message):
            await self.send_frame(peer, self._encode(message))

    async def broadcast(self, peers: tuple[bytes, ...], message: CoordinatorMessage) -> None:
        """``message`` to each of ``peers`` that understands it, encoded once. A test may cut
        a broadcast after its first peer and end the process there (:mod:`.faults`)."""
        if message.optional:
            peers = tuple(peer for peer in peers if self.understood(peer, message))
        data = self._encode(message)
        cut = faults.cut(message)  # a test's kill between two sends of a decision
        await self._each(peers if cut is None else peers[:1], data)
        if cut is not None:
            faults.die(cut)

    async def _each(self, peers: tuple[bytes, ...], data: bytes) -> None:
        """``data`` to every one of ``peers``: two plain sends each, with no coroutine per peer,
        which at thousands of peers cost half as much again as the sends themselves."""
        assert self._socket is not None and self._io is not None, "attach a socket first"
        send, more, last = self._io.send, zmq.SNDMORE | zmq.NOBLOCK, zmq.NOBLOCK
        for peer in peers:
            try:
                send(peer, more)  # a message is queued whole or not at all: only this waits
            except zmq.Again:  # not for a ROUTER as configured here; if ever, wait as asyncio would
                await self._socket.send_multipart([peer, data])
                continue
            send(data, last)

    async def send_frame(self, peer: bytes, data: bytes) -> None:
        """One encoded frame to ``peer``."""
        assert self._socket is not None and self._io is not None, "attach a socket first"
        try:
            self._io.send_multipart([peer, data], zmq.NOBLOCK)
        except zmq.Again:  # not for a ROUTER as configured here; if ever, wait as asyncio would
            await self._socket.send_multipart([peer, data])
