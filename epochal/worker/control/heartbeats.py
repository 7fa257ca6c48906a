"""The control thread's heartbeats and its watch on the coordinator.

Every heartbeat interval the thread sends a Status (the phase, epoch and step the training code
is at, and the line it runs) and checks that the coordinator is still there: a connection that
closed and did not come back, or a coordinator silent past the run's heartbeat timeout, is a
lost coordinator. The socket's events say when a connection opened, when its handshake succeeded
or failed (a CURVE key the coordinator refused fails at once) and when it closed.

:class:`Heartbeats` is the part of :class:`~epochal.worker.control.client.ControlClient` that does
it; the client sets every attribute below in its ``__init__``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epochal.protocol import Awaiting, Liveness, Phase, Status, WorkerMessage, clip
from epochal.security.curvekeys import ClientSecurity, describe_handshake_failure
from epochal.worker.control.progress import CpuProgress
from epochal.worker.control.waiting import Handshake


def beat_due(now: float, sent_at: float, interval: float) -> float | None:
    """None when a heartbeat is due at ``now`` (nothing was sent for ``interval`` seconds since
    ``sent_at``), else the instant it falls due: ``interval`` after the last frame sent."""
    if now - sent_at >= interval:
        return None
    return sent_at + interval


class Heartbeats:
    """Heartbeats and the coordinator watched; see the module docstring."""

    endpoint: str
    liveness: Liveness
    handshake: Handshake
    epoch: int
    step: int
    busy: CpuProgress | None
    _security: ClientSecurity | None
    _outbox: asyncio.Queue[WorkerMessage | None] | None
    _last_heard: float | None
    _disconnected: float | None
    _up: bool
    _watch_coordinator: bool
    _abort_reason: str | None
    _progress_at: float
    _sent_at: float
    _doing: tuple[Phase, Awaiting | None]
    _main_thread: int

    def _fail(self, reason: str) -> None:
        raise NotImplementedError  # the client's

    def _lose(self, reason: str) -> None:
        raise NotImplementedError  # the client's

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Socket events: a refused handshake fails at once; a handshake that does not complete
        is noted (the connect deadline's line says the coordinator does not answer); a closed
        connection is suspicious."""
        curve = self._security is not None
        while True:
            parsed = parse_monitor_message(await monitor.recv_multipart())
            event, now = parsed["event"], time.monotonic()
            if event == zmq.EVENT_CONNECTED:
                self.handshake.connected(now)
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake.succeeded()
                self._up = True
                continue
            # without detail: closed by the coordinator during a CURVE handshake (a key it cannot
            # read) fails; anything else is no answer, which libzmq retries and the deadline says
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not (
                self.handshake.failed(now) and curve
            ):
                continue
            problem = describe_handshake_failure(event, parsed["value"], curve=curve)
            if problem is not None:
                self._fail(problem)
            elif event == zmq.EVENT_DISCONNECTED:
                self._up = False
                if self._watch_coordinator:
                    self._disconnected = now

    async def _tick(self) -> None:
        """Every heartbeat interval: a Status, unless the thread sent a frame meanwhile (any frame
        tells the coordinator this worker lives; a loss report is one a rank every epoch, which
        makes epochs shorter than the interval cost the coordinator one frame a rank, not two);
        then the watch on the coordinator. No interval passes without a frame sent or a check."""
        assert self._outbox is not None
        interval = self.liveness.interval
        due = time.monotonic() + interval
        while True:
            slept = time.monotonic()
            await asyncio.sleep(max(0.0, due - slept))
            now = time.monotonic()
            if now - slept > self.liveness.timeout and self._last_heard is not None:
                # this process was not running (frozen by SIGSTOP, a paused machine): the silence
                # was its own. What the coordinator sent meanwhile is waiting to be read (an
                # abort, say: this worker was dropped), so its clock starts again now
                self._last_heard = time.monotonic()
            self._own_progress()
            interval = self.liveness.interval  # the run's, once welcomed
            later = beat_due(now, self._sent_at, interval)
            if later is None:
                self._beat()
            due = now + interval if later is None else later
            heard = self._last_heard
            gone = self._disconnected
            if (
                self._watch_coordinator
                and gone is not None
                and time.monotonic() - gone > 2 * self.liveness.interval
            ):
                # the connection closed and nothing came back over a new one: the coordinator's
                # process is gone (a network blip reconnects and clears this within the window)
                self._lose(f"the connection to the coordinator at {self.endpoint} closed")
                continue
            if (
                self._watch_coordinator
                and heard is not None
                and time.monotonic() - heard > self.liveness.timeout
                and self._abort_reason is None
            ):
                self._lose(
                    f"the coordinator at {self.endpoint} sent nothing for "
                    f"{self.liveness.timeout:g} s: it died or the network to it is down"
                )

    def _own_progress(self) -> None:
        """Count a step when training code with a loop of its own used CPU since the last one."""
        busy = self.busy
        if busy is not None and busy.grew():
            self.step += 1
            self._progress_at = time.monotonic()

    def _beat(self) -> None:
        """Queue a heartbeat saying where the training code is (on this thread)."""
        if self._outbox is not None:
            phase, awaiting = self._doing
            self._outbox.put_nowait(Status(phase, self.epoch, self.step, self._where(), awaiting))

    def _where(self) -> str:
        """Where the main thread is right now: its innermost frame, as ``file.py:12 in fn``."""
        frame = sys._current_frames().get(self._main_thread)
        if frame is None:
            return ""
        code = frame.f_code
        return clip(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}", 200)
