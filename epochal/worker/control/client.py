"""The worker's control client: a ZeroMQ DEALER on its own daemon thread with its own asyncio loop.

The training code's main thread calls :meth:`ControlClient.send` and :meth:`ControlClient.receive`;
the thread keeps heartbeats flowing while the main thread is busy in a step or a collective, and
turns an Abort or a vanished coordinator into :class:`~epochal.errors.RunAborted` at the main
thread's next call (or its next :meth:`check`, made between batches). Each of the thread's tasks is
watched: one that dies fails the worker at once, with its cause, both here (the next call raises)
and at the coordinator (a Failed message), instead of leaving a silence that the coordinator would
later blame on the worker's network. If the main thread does not come back within ``abort_grace``
seconds (it is stuck in a collective whose peer is gone), the thread prints the reason and ends the
process (:mod:`~epochal.worker.control.backstop`): a bounded abort instead of a hang. The same holds
for a coordinator that vanished while the training code was away: a worker that keeps making
progress finishes its epoch and then waits to re-attach, but one whose training code made no
progress for the run's heartbeat timeout + ``abort_grace`` seconds is blocked in a collective (its
peer was cut off with it, or is gone) and could never re-attach, so it exits.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from epochal.errors import CoordinatorLost, EpochalError, MalformedMessage, RunAborted
from epochal.log import WORKER, ensure_configured
from epochal.protocol import (
    Abort,
    Awaiting,
    CoordinatorMessage,
    DescribeModel,
    Failed,
    Heartbeat,
    Hello,
    Joined,
    Liveness,
    ParamSpec,
    Phase,
    Regroup,
    Reject,
    Welcome,
    WorkerMessage,
    clip,
    encode,
)
from epochal.protocol.codec import decode_frame
from epochal.protocol.messages import TYPE_NAMES, check_phase
from epochal.protocol.paging import model_page
from epochal.protocol.skipped import SkippedFields
from epochal.security.curvekeys import ClientSecurity
from epochal.text import REASON_CHARS, printable
from epochal.worker import faults
from epochal.worker.control.backstop import exit_if_stuck, exit_unless_taken
from epochal.worker.control.dealer import LINGER_MS, Dealer
from epochal.worker.control.heartbeats import Heartbeats
from epochal.worker.control.progress import CpuProgress
from epochal.worker.control.waiting import Handshake
from epochal.worker.joinoptions import JoinOptions

DEFAULTS = JoinOptions()

ABORT_CHARS = 8 * REASON_CHARS
"""Longest abort reason a worker shows: the coordinator's reason names at most a few failures of
at most :data:`~epochal.text.REASON_CHARS` each; anything past that is cut, control characters
escaped, since every rank prints it."""

HANDSHAKE_TIMEOUT = 30.0
"""Seconds a connection's ZeroMQ handshake may take before libzmq drops it and connects again
(libzmq's default). Not shorter: a coordinator accepting thousands of connections at once, on a
loaded machine, may take that long, and dropping a connection sends it to the back of the
queue."""


@dataclass(frozen=True, slots=True)
class _Lost:
    """Synthetic inbox entry: the coordinator went silent or no longer knows this worker."""

    reason: str
    reattach: bool = False
    # True: a restarted coordinator may take the worker back (raise CoordinatorLost)


class RegroupNow(Exception):
    """Raised into the training code between two batches (:meth:`ControlClient.check`) or while
    it waits for the coordinator: the world changes, leave the process group now."""

    def __init__(self, regroup: Regroup) -> None:
        super().__init__(f"the world changes (generation {regroup.generation})")
        self.regroup = regroup


class ControlClient(Heartbeats):
    """Owns the DEALER socket; safe to call from one user thread while its own thread runs."""

    def __init__(
        self,
        endpoint: str,
        identity: bytes,
        options: JoinOptions = DEFAULTS,
        *,
        security: ClientSecurity | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        """``options`` gives ``abort_grace`` and whether to re-attach. The heartbeats are the
        run's: ``liveness`` until the coordinator's Joined or Welcome says what they are (the
        defaults of ``--heartbeat-interval`` and ``--heartbeat-timeout`` when None)."""
        self.endpoint = endpoint
        self.identity = identity
        self.liveness = liveness if liveness is not None else Liveness()
        # the run's heartbeat interval and timeout; replaced whole (one assignment) when the
        # coordinator says them, so the heartbeat task never reads half a change
        self.abort_grace = options.abort_grace
        self._inbox: queue.Queue[CoordinatorMessage | _Lost] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue[WorkerMessage | None] | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._last_heard: float | None = None
        self._abort_reason: str | None = None
        self._abort_taken = threading.Event()
        self._watch_coordinator = False
        self._reattach = options.reattach
        self._reattach_timeout = options.reattach_timeout
        self._security = security
        self._session = ""
        # the secret the coordinator issued in Joined/Welcome; sent with every frame but a hello
        self.understands: frozenset[str] = frozenset()
        self._held_back: set[str] = set()
        # the optional message types the coordinator's welcome said it understands: no other
        # optional type is sent to it (:meth:`send` drops it, and says so once)
        self._skipped = SkippedFields("worker")
        # the fields a newer coordinator's frames carried that this version skips, logged once
        self._disconnected: float | None = None
        # when the connection to the coordinator closed (its process died?); None: connected
        self._up = False  # the connection to the coordinator is up (its handshake succeeded)
        # when the control thread last sent a frame: a heartbeat is due an interval after it
        self._sent_at = time.monotonic()
        self._linger = LINGER_MS  # how long closing tries to send what is queued, in ms
        self._finished = False  # closed once the run is over and this worker said Done
        self._main_thread = threading.get_ident()  # made on the training code's thread
        self._progress_at = time.monotonic()
        # when the main thread last showed progress (a step, a phase, a call into the client)
        self._loss_taken = threading.Event()
        # set when the main thread has taken the latest coordinator loss (or closed the client)
        self.rank: int | None = None
        # this worker's rank once it has one (for fault injection)
        self.model_params: tuple[ParamSpec, ...] = ()
        # the entries of this worker's model, sent a page at a time when the coordinator asks
        self.handshake = Handshake(endpoint, HANDSHAKE_TIMEOUT, curve=security is not None)
        # the connection's handshakes: whether the coordinator answers a connection at all
        self._doing: tuple[Phase, Awaiting | None] = (Phase.RENDEZVOUS, None)
        # (phase, awaiting) in one attribute, so the loop's heartbeat never reads half a change
        self.epoch = 0
        self.step = 0
        # where the training code is; set by the main thread, sent with every heartbeat
        self._regroup: Regroup | None = None
        self.on_regroup: Callable[[Regroup], None] | None = None
        # called in this client's thread when a Regroup arrives, before the main thread sees it:
        # the session shuts its process group's connections there, so that a main thread blocked
        # in a collective with a peer that is gone without closing them (frozen, cut off) raises
        # now instead of at the collective timeout
        # the newest world change the main thread has not taken yet
        self._regroup_taken = threading.Event()
        self.busy: CpuProgress | None = None
        # training code that runs a loop of its own (a session opened for the rendezvous only, a
        # torchrun script): each heartbeat counts a step when it used CPU (see .progress); None:
        # the steps the training code reports say its progress

    @property
    def phase(self) -> Phase:
        """The phase the training code is in (set with :meth:`at`)."""
        return self._doing[0]

    @phase.setter
    def phase(self, phase: Phase) -> None:
        self._doing = (phase, self._doing[1])

    @property
    def awaiting(self) -> Awaiting | None:
        """In :attr:`Phase.WAITING`: the answer the training code waits for."""
        return self._doing[1]

    # ------------------------------------------------------------------ main-thread API

    def start(self) -> None:
        ensure_configured()  # the lines it writes when it ends the process must not be lost
        self._thread = threading.Thread(target=self._run, name="epochal-control", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise EpochalError(f"control client failed to start: {self._error}") from self._error

    @property
    def session(self) -> str:
        """The session the coordinator issued this worker ("" before it was admitted)."""
        return self._session

    def unanswered(self) -> str | None:
        """Why the coordinator has not answered, when a connection opened and its handshake never
        completed (see :class:`~epochal.worker.control.waiting.Handshake`); None otherwise."""
        return self.handshake.unanswered(time.monotonic())

    def watch_coordinator(self) -> None:
        """From now on a silent coordinator counts as lost (called once the worker has joined)."""
        self._last_heard = time.monotonic()
        self._watch_coordinator = True

    def _lose(self, reason: str) -> None:
        """The coordinator is gone: stop watching and tell the main thread once."""
        if not self._watch_coordinator or self._abort_reason is not None:
            return
        self._watch_coordinator = False
        if self._reattach:
            taken = self._loss_taken = threading.Event()
            self._inbox.put(_Lost(reason, reattach=True))
            # a rank blocked in a collective may be waiting for a peer that is saying hello to a
            # restarted coordinator, which will send it what this rank got (takeback.py): it
            # waits as long as that may take before it counts as blocked for good
            threading.Thread(
                target=self._exit_if_stuck,
                args=(reason, taken, self._reattach_timeout),
                name="epochal-lost",
                daemon=True,
            ).start()
        else:
            if self._outbox is not None:  # a coordinator that was only stopped reads why, later
                self._outbox.put_nowait(Failed(reason=clip(f"it gave up waiting: {reason}")))
            self._fail(reason)

    def send(self, message: WorkerMessage) -> None:
        """Queue ``message`` for the coordinator; an optional type the coordinator did not say it
        understands is not sent (said once): check :attr:`understands` to send another instead."""
        loop, outbox = self._loop, self._outbox
        if loop is None or outbox is None or loop.is_closed():
            raise EpochalError("the control client is closed")
        name = TYPE_NAMES[type(message)]
        if message.optional and name not in self.understands:
            if name not in self._held_back:
                self._held_back.add(name)
                WORKER.info(
                    f"the coordinator, of an older version, does not understand {name} messages: "
                    "none is sent to it (said once)"
                )
            return
        loop.call_soon_threadsafe(outbox.put_nowait, message)

    def receive(self, timeout: float | None = None) -> CoordinatorMessage:
        """The next message from the coordinator (heartbeats excluded).

        Raises TimeoutError when ``timeout`` passes first, RunAborted on an Abort or when the
        coordinator went silent.
        """
        self._progress_at = time.monotonic()
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no message from the coordinator") from None
        finally:
            self._progress_at = time.monotonic()
        if isinstance(item, _Lost):
            if item.reattach:
                self._loss_taken.set()
                raise CoordinatorLost(item.reason)
            self._abort_taken.set()
            raise RunAborted(item.reason)
        if isinstance(item, Abort):
            self._abort_taken.set()
            raise RunAborted(item.reason)
        return item

    def at(
        self,
        phase: Phase,
        epoch: int,
        awaiting: Awaiting | None = None,
        *,
        announce: bool = True,
    ) -> None:
        """The training code enters ``phase`` of ``epoch`` (reported with the next heartbeat).

        ``awaiting``: in :attr:`Phase.WAITING` (and only there), the answer it waits for, so the
        coordinator tells a slow Go from a lost loss report. A change of phase or of what it
        awaits is reported at once, so the coordinator's view is current even if the main thread
        now blocks for long (in the data plane's connect, say); ``announce=False`` when the
        message the caller sends next says the same (an ``epoch_report`` tells the coordinator
        that its rank now waits for the decision): one frame per rank fewer for the coordinator
        to read each epoch, and the heartbeats say it anyway. Raises ValueError for anything but
        a :class:`~epochal.protocol.Phase` (or its value), or an ``awaiting`` given in another
        phase or missing in the waiting one.
        """
        new = check_phase(phase)
        if awaiting is not None:
            awaiting = Awaiting(awaiting)
        if (new is Phase.WAITING) != (awaiting is not None):
            raise ValueError("awaiting is given exactly when the phase is waiting")
        changed = (new, awaiting) != self._doing
        self._doing, self.epoch, self.step = (new, awaiting), epoch, 0
        self._progress_at = time.monotonic()
        loop = self._loop
        if changed and announce and loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._beat)
            except RuntimeError:  # the loop closed meanwhile: nobody to tell
                pass

    def check(self) -> None:
        """Raise RunAborted if an abort has arrived; cheap enough to call between batches.

        Each call also counts one step of progress for the stall diagnostics.
        """
        self.step += 1
        self._progress_at = time.monotonic()
        reason = self._abort_reason
        if reason is not None:
            self._abort_taken.set()
            raise RunAborted(reason)
        regroup = self._regroup
        if regroup is not None and not self._regroup_taken.is_set():
            raise RegroupNow(regroup)

    def take_regroup(self, regroup: Regroup) -> None:
        """The main thread follows ``regroup`` (it has left its process group, or is leaving)."""
        if self._regroup is regroup:
            self._regroup_taken.set()

    def close(self, *, flush: float = LINGER_MS / 1000, finished: bool = False) -> None:
        """Send what is queued (waiting up to ``flush`` seconds) and stop the thread.

        ``finished``: the run is over and this worker said so (Done). Then, once the coordinator
        has closed the connection, what is still queued (heartbeats sent meanwhile) has nobody
        to go to, and the socket closes at once instead of trying for ``flush`` seconds."""
        self._linger, self._finished = int(flush * 1000), finished
        self._abort_taken.set()
        self._loss_taken.set()
        loop, outbox = self._loop, self._outbox
        if loop is not None and outbox is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(outbox.put_nowait, None)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=flush + 1.0)

    # ------------------------------------------------------------------ control thread

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # recorded and acted on by the main thread, never lost
            self._error = exc
            self._started.set()
            self._fail(f"the control thread crashed: {type(exc).__name__}: {exc}")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        dealer = Dealer(self.endpoint, self.identity, self.handshake.timeout, self._security)
        sock = dealer.socket
        self._started.set()
        reader = self._watched(self._read(sock), "reading the coordinator's messages")
        ticker = self._watched(self._tick(), "sending heartbeats")
        watcher = self._watched(self._watch(dealer.monitor), "watching the connection")
        try:
            while True:
                message = await self._outbox.get()
                if message is None:
                    break
                session = "" if isinstance(message, Hello) else self._session
                frame = encode(message, session=session)
                data = faults.on_send(TYPE_NAMES[type(message)], frame, rank=self.rank)
                if data is not None:
                    await sock.send(data)
                    self._sent_at = time.monotonic()
        finally:
            for task in (reader, ticker, watcher):
                task.cancel()
            try:
                await asyncio.gather(reader, ticker, watcher, return_exceptions=True)
            finally:  # closed even if this wait is cut short; a finished worker's coordinator
                # that closed the connection got its Done
                dealer.close(linger=0 if self._finished and not self._up else self._linger)

    def _watched(self, work: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        """Run ``work`` as a task of this thread whose end, other than by cancelling, fails us."""
        task = asyncio.create_task(work, name=f"epochal-control: {what}")
        task.add_done_callback(functools.partial(self._task_ended, what))
        return task

    def _task_ended(self, what: str, task: asyncio.Task[None]) -> None:
        """A task's done-callback (on this thread): every task is meant to run until cancelled."""
        if task.cancelled():
            return
        exc = task.exception()
        cause = "it returned" if exc is None else f"{type(exc).__name__}: {exc}"
        reason = (
            f"this worker's control client stopped {what} ({cause}); the worker cannot go on "
            "without it (a bug in epochal or in code calling its client: please report it)"
        )
        if self._outbox is not None:  # the coordinator learns the cause, not just a silence
            self._outbox.put_nowait(Failed(reason=clip(reason)))
        self._fail(reason)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            if not await sock.poll(timeout=200):
                continue
            data = await sock.recv()
            self._last_heard = time.monotonic()
            self._disconnected = None
            try:
                decoded = decode_frame(data)
            except MalformedMessage as exc:
                self._fail(f"the coordinator sent a malformed message: {exc}")
                continue
            message = decoded.message
            if decoded.skipped:
                for line in self._skipped.news(decoded):
                    WORKER.info(line)
            if isinstance(message, Heartbeat):
                continue
            if isinstance(message, DescribeModel):  # answered here, whatever the main thread does
                params = self.model_params
                assert self._outbox is not None
                self._outbox.put_nowait(model_page(params, min(message.first, len(params))))
                continue
            if isinstance(message, Regroup):  # raised by check() until the main thread takes it
                self._regroup = message
                self._regroup_taken.clear()
                if self.on_regroup is not None:
                    try:
                        self.on_regroup(message)
                    except Exception as exc:  # the exit-if-stuck timer below still holds
                        WORKER.warning(f"epochal: could not leave the process group early: {exc}")
                threading.Thread(
                    target=self._exit_if_stuck,
                    args=(
                        f"the run's world changes (generation {message.generation}) and this "
                        "worker must leave its process group",
                        self._regroup_taken,
                    ),
                    name="epochal-regroup",
                    daemon=True,
                ).start()
            if isinstance(message, Joined | Welcome):
                self._session = message.session
                self.liveness = message.liveness  # the run's heartbeats, from now on
            if isinstance(message, Welcome):
                self.understands = frozenset(message.understands)
            if isinstance(message, Abort):
                # printed by every rank and raised into the training code: one line, bounded,
                # whatever the coordinator sent (it may name several ranks' failures)
                message = Abort(reason=printable(message.reason, ABORT_CHARS))
                self._begin_abort(message.reason)
            elif isinstance(message, Reject) and message.code == "not_member":
                # a member is unknown only to a coordinator that restarted; outside a run (during
                # a re-attach) it answers a message queued while the coordinator was down
                self._lose(
                    f"the coordinator at {self.endpoint} no longer knows this worker "
                    "(it restarted?)"
                )
                continue
            self._inbox.put(message)  # type: ignore[arg-type]

    def _fail(self, reason: str) -> None:
        self._begin_abort(reason)
        self._inbox.put(_Lost(reason))

    def _begin_abort(self, reason: str) -> None:
        if self._abort_reason is not None:
            return
        self._abort_reason = reason
        threading.Thread(
            target=self._exit_unless_taken, args=(reason,), name="epochal-abort", daemon=True
        ).start()

    def _exit_unless_taken(self, reason: str) -> None:
        exit_unless_taken(reason, self._abort_taken, self.abort_grace)

    def _exit_if_stuck(self, reason: str, taken: threading.Event, more: float = 0.0) -> None:
        """The coordinator is lost (or the world changes): end the process if the training code
        is blocked for good (:func:`~epochal.worker.control.backstop.exit_if_stuck`), ``more``
        seconds later than it would otherwise."""
        who = f"rank {self.rank}" if self.rank is not None else "worker"
        exit_if_stuck(
            reason,
            taken,
            self.abort_grace + more,
            lambda: self.liveness,
            lambda: self._progress_at,
            who,
        )
