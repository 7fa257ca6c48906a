"""Frames in: what the coordinator's service reads of each received frame, and how.

:class:`Intake` takes one ROUTER message (routing id, frame) and the clock, and returns what the
:class:`~epochal.coordinator.rules.machine.RunMachine` makes of it. A stranger past its budget is
not
read at all, and what a stranger's frame that is read takes is measured and counted against the
strangers' share of the coordinator's time; of a stranger only a hello is decoded; a member's
retried hello is known by its bytes (:class:`~.retries.HelloRetries`) and never decoded again;
fields of a newer minor version are skipped and logged once each. It also tells the connection
guard which connections carry a member's frames, so those are never dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from epochal.coordinator.rules.actions import Action
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.retries import HelloRetries
from epochal.coordinator.serve.guard import ConnectionGuard
from epochal.errors import MalformedMessage, ProtocolVersionMismatch
from epochal.protocol import TYPE_NAMES, Hello, Message
from epochal.protocol.codec import decode_frame, message_type
from epochal.protocol.skipped import SkippedFields

HELLO = TYPE_NAMES[Hello]


def _user_id(frame: Any, secured: bool) -> str:
    """The ZAP user id (under CURVE: the sender's public key) of a received frame; "" without
    (``secured`` False: no frame has one, and asking raises, which costs more than the frame)."""
    if not secured or isinstance(frame, bytes):
        return ""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:  # no security mechanism on this connection: no user id
        return ""


class Intake:
    """Reads received frames for one coordinator; see the module docstring. ``machine`` and
    ``guard`` are set once the service has them."""

    def __init__(
        self,
        secured: bool,
        log: Callable[[str], None],
        *,
        world_size: int,
        cost_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self._secured = secured
        self._cost_clock = cost_clock
        # what a stranger's frame took is measured on it: this thread's CPU time
        self._stranger: tuple[bytes, float] | None = None
        # the stranger whose frame is being read and answered, and when it was taken up
        self._log = log
        self._world_size = world_size
        self._skipped = SkippedFields("coordinator")
        # the fields newer workers' frames carried that this version skips, logged once each
        self._retries = HelloRetries()
        # each member's last admitted hello, known again by its bytes without decoding them
        self._machine: RunMachine | None = None
        self._guard: ConnectionGuard | None = None

    @property
    def machine(self) -> RunMachine:
        assert self._machine is not None, "the service sets the machine first"
        return self._machine

    def attach(self, machine: RunMachine, guard: ConnectionGuard | None = None) -> None:
        """The run's machine, and once the socket is configured its connection guard."""
        self._machine = machine
        if guard is not None:
            self._guard = guard

    def receive(self, frames: list[Any], now: float) -> list[Action]:
        """What the machine makes of one received message (``frames``: routing id, frame); the
        caller carries it out and then calls :meth:`answered`."""
        machine = self.machine
        if len(frames) != 2:
            machine.gate.dropped_frames += 1
            return []
        peer = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        if peer in machine.gate.sessions:
            return self._read(frames, peer, now)
        if not machine.reads(now, peer):
            return []  # a stranger past its own or the strangers' budget: not even read
        self._stranger = (peer, self._cost_clock())
        return self._read(frames, peer, now)

    def answered(self, now: float) -> None:
        """The frame :meth:`receive` returned the actions of was carried out: if it was a
        stranger's that did not make it a member (a joining worker's hello does), what it took,
        from its reading to its answer, is counted against the strangers' share of the
        coordinator's time (:meth:`~.strangers.Gate.took`)."""
        if self._stranger is not None:
            peer, since = self._stranger
            self._stranger = None
            if peer not in self.machine.gate.sessions:
                self.machine.gate.took(now, self._cost_clock() - since)

    def _read(self, frames: list[Any], peer: bytes, now: float) -> list[Action]:
        machine = self.machine
        data = frames[1] if isinstance(frames[1], bytes) else frames[1].buffer  # not copied
        size = len(data) if isinstance(data, bytes) else data.nbytes
        user_id = _user_id(frames[1], self._secured)
        members = machine.rendezvous.members
        retried = self._retries.match(peer, data, size) if peer in members else None
        if retried is not None:  # the same bytes decode to the same hello: act on that one
            hello, session = retried
            actions = machine.on_message(now, peer, hello, session=session, user_id=user_id)
            self._from_member(frames[1], peer, hello, session, user_id)
            return actions
        try:
            if not machine.knows(peer):  # a stranger: only its hello is worth decoding
                kind = message_type(data)
                if kind != HELLO:
                    return machine.on_stranger(peer, kind)
            decoded = decode_frame(data)
        except ProtocolVersionMismatch as exc:
            return machine.on_unreadable(now, peer, str(exc), version=True)
        except MalformedMessage as exc:
            return machine.on_unreadable(now, peer, str(exc), version=False, user_id=user_id)
        message, session = decoded.message, decoded.session
        if decoded.skipped:
            for line in self._skipped.news(decoded):
                self._log(line)
        actions = machine.on_message(now, peer, message, session=session, user_id=user_id)
        self._from_member(frames[1], peer, message, session, user_id)
        if isinstance(message, Hello):
            self._remember(peer, data, size, message, session, user_id)
        return actions

    def _from_member(
        self, frame: Any, peer: bytes, message: Message, session: str, user_id: str
    ) -> None:
        """Tell the guard when a frame the run acted on as a member's (an admitted hello, or one
        with the member's session) came on a connection it does not know yet: that connection
        is then never dropped."""
        fd = None if self._guard is None else self._guard.unknown(frame)
        if fd is None:  # a known member's connection: nothing to check
            return
        sessions = self.machine.gate.sessions
        if peer in sessions and (
            sessions.same_sender(peer, user_id)
            if isinstance(message, Hello)
            else sessions.check(peer, session, user_id)
        ):
            assert self._guard is not None
            self._guard.admit(fd, peer)

    def _remember(
        self,
        peer: bytes,
        data: bytes | memoryview,
        size: int,
        hello: Hello,
        session: str,
        user_id: str,
    ) -> None:
        """Remember a hello the run admitted for ``peer`` (it is a member under that worker id,
        bound to the key the hello came with), to know its retries by their bytes."""
        machine = self.machine
        member = machine.rendezvous.members.get(peer)
        if (
            member is None
            or member.hello.worker_id != hello.worker_id
            or not machine.gate.sessions.same_sender(peer, user_id)
        ):
            return
        self._retries.admitted(peer, data, size, member.hello, session)  # its shared fingerprint
        self._retries.prune(machine.rendezvous.members, self._world_size)
