"""The coordinator service: one ZeroMQ ROUTER socket and one asyncio task that moves messages.

It reads a frame and the clock, decodes the frame, hands both to the pure
:class:`~epochal.coordinator.rules.machine.RunMachine` and applies the actions it returns: sends,
journal
records, log lines, deleted checkpoints, the end of the run. Every decision all ranks must share is
taken there, once; here are only the socket, the files and the clock. Deleting old checkpoints and
telling the observers (status.json, TensorBoard) go to threads (:mod:`.upkeep`): the loop that
sends heartbeats never waits on a disk. The service never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules import clock
from epochal.coordinator.rules.actions import (
    Aborted,
    Action,
    Broadcast,
    Finished,
    Journal,
    Log,
    Prune,
    RunPhase,
    RunSummary,
    Send,
)
from epochal.coordinator.rules.holding import hold_limits
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.runstate import RunState
from epochal.coordinator.serve import oslimits, resume, serving
from epochal.coordinator.serve.attempts import RunAttempt, attempt_of, new_run_id
from epochal.coordinator.serve.connections import Connections, connection_limits
from epochal.coordinator.serve.directories import check_directories
from epochal.coordinator.serve.feed import ObserverFeed
from epochal.coordinator.serve.guard import ConnectionGuard, open_files
from epochal.coordinator.serve.intake import Intake
from epochal.coordinator.serve.journal import Journal as RunJournal
from epochal.coordinator.serve.journal import JournalError
from epochal.coordinator.serve.modelfile import ModelFile
from epochal.coordinator.serve.outbox import Outbox
from epochal.coordinator.serve.recording import Recording
from epochal.coordinator.serve.router import LINGER_MS, RECEIVE_HWM, open_router
from epochal.coordinator.serve.upkeep import Upkeep
from epochal.errors import RunAborted
from epochal.log import COORDINATOR, ensure_configured
from epochal.nofile import raise_nofile_limit
from epochal.observe import RunObserver
from epochal.protocol import MAX_FRAME_BYTES, Heartbeat, encode
from epochal.security.curvekeys import RefusedHandshakes, ServerSecurity

__all__ = ["Coordinator", "RunPhase", "RunSummary", "new_run_id"]


def _log_line(line: str) -> None:
    ensure_configured()
    COORDINATOR.info(line)


class Coordinator(Recording):
    """Runs one training job's control plane.

    ``await start()`` reads the run directory (deleting it first when ``fresh``), binds and returns
    the endpoint (port 0 is resolved); ``await run()`` serves until the run finishes (returns a
    RunSummary) or is aborted (raises RunAborted).

    ``observers`` (status.json, TensorBoard, metrics: :mod:`epochal.observe`) are told of the start,
    the joins, every journal record with a snapshot, a snapshot every heartbeat interval, and the
    end, and of nothing after it, in that order, on a thread of their own (never the event loop's;
    :meth:`run` returns once they have heard the end). Their owner builds one set for every
    attempt of a run (``attempt`` counts the coordinators started again after a failure) and
    closes it outside the event loop.

    ``workers_here``: the workers run on this machine, so the checkpoint directory they write is
    made and tried at the start like the run directory (see :mod:`.directories`).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        bind: str = "tcp://127.0.0.1:0",
        log: Callable[[str], None] = _log_line,
        context: zmq.asyncio.Context | None = None,
        run_id: str | None = None,
        fresh: bool = False,
        security: ServerSecurity | None = None,
        observers: RunObserver | None = None,
        attempt: int = 0,
        workers_here: bool = False,
    ) -> None:
        self.config = config
        self._workers_here = workers_here
        # the workers run on this machine (epochal run): their checkpoint directory is made and
        # tried here before they start, as the run directory is
        self._upkeep = Upkeep(observers, log)
        # old checkpoints deleted and the observers told, off the event loop (.upkeep)
        self._observers = self._upkeep.observers
        self._feed = ObserverFeed(self._observers)
        self._attempt = attempt
        self._accept_failures = oslimits.AcceptFailures(config.world_size)
        self._monitor = oslimits.AcceptMonitor()
        # the ROUTER's monitor: connections accepted, closed, or not accepted (out of descriptors)
        self._guard: ConnectionGuard | None = None
        # which connections are members', and the drops of those that are not (after start())
        self.bind_address = bind
        self.endpoint: str | None = None
        self.run_id = run_id or new_run_id()
        self.attempt = RunAttempt.first(self.run_id)  # the run directory's may say otherwise
        self._log = log
        self._fresh = fresh
        self._security = security
        # one ZAP authenticator per context: a secured coordinator gets a context of its own
        self._own_context = security is not None and context is None
        self._context = (
            zmq.asyncio.Context()
            if self._own_context
            else context or zmq.asyncio.Context.instance()
        )
        self._auth: Any = None
        self.refused_handshakes = RefusedHandshakes()
        # CURVE handshakes the allow-list refused: logged, and named by a rendezvous timeout
        self._socket: zmq.asyncio.Socket | None = None
        self._io: zmq.Socket[Any] | None = None
        # the socket without asyncio's futures, for reads and sends that never wait (.outbox)
        self._outbox = Outbox(
            lambda peer, message: self.machine.understands(peer, message),
            log,
            encode=lambda message: encode(message),  # this module's, looked up when sending
        )
        self._state: RunState | None = None
        self._machine: RunMachine | None = None
        self._ended = False
        self._requested_abort: str | None = None
        self._stood_down: str | None = None  # see stand_down
        self._outcome: RunSummary | RunAborted | None = None
        self._journal: RunJournal | None = None
        self._clock_read = time.monotonic()
        # the last reading of the service's clock (see clock.lost_time)
        self._intake = Intake(security is not None, self._log, world_size=config.world_size)
        # frames read, decoded (a member's retried hello known by its bytes) and handed on

    # ------------------------------------------------------------------ what others read

    @property
    def phase(self) -> RunPhase:
        if self._ended:
            return RunPhase.ENDED
        return RunPhase.RENDEZVOUS if self._machine is None else self._machine.phase

    @property
    def finished(self) -> dict[str, Any] | None:
        """result.json of a run directory whose run already finished (nothing left to train)."""
        return None if self._state is None else self._state.finished

    @property
    def dropped_frames(self) -> int:
        """Frames that could not be read (malformed, oversized, another protocol version)."""
        return 0 if self._machine is None else self._machine.gate.dropped_frames

    @property
    def ignored_frames(self) -> int:
        """Frames from strangers past their reply budget, dropped without an answer."""
        return 0 if self._machine is None else self._machine.gate.ignored_frames

    @property
    def forged_frames(self) -> int:
        """Frames under a member's routing identity without its session (or key)."""
        return 0 if self._machine is None else self._machine.gate.forged_frames

    @property
    def machine(self) -> RunMachine:
        """The run's decision logic (after :meth:`start`)."""
        assert self._machine is not None, "start() first"
        return self._machine

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        """Check the run directory (and the checkpoint directory, if seen from here) is the
        user's alone and writable, then read it (after --fresh: first empty it); once per
        coordinator."""
        if self._state is not None:
            return
        checkpoint_dir = self.config.checkpoint_path
        here = self._workers_here
        check_directories(self.config.run_dir, checkpoint_dir, workers_here=here)
        if self._fresh:
            resume.start_fresh(self.config, checkpoint_dir)
            check_directories(None, checkpoint_dir, workers_here=here)  # made again, empty
        self._state = resume.inspect(self.config, checkpoint_dir)
        if self._workers_here:  # epochal run starts every worker anew: none to take back
            self._state.carry = None
        self.attempt = attempt_of(self._state, self.run_id)  # the run's id kept (.attempts)
        self.run_id = self.attempt.run_id
        run_dir = self.config.run_dir
        self._machine = RunMachine(
            self.config,
            self._state,
            run_id=self.run_id,
            attempt_id=self.attempt.attempt_id,
            now=time.monotonic(),
            model_record=None if run_dir is None else ModelFile(run_dir),
            rendezvous_note=self._rendezvous_note,
        )
        self._intake.attach(self._machine)

    def _rendezvous_note(self) -> str:
        """Why a rendezvous may fall short besides missing workers."""
        accepts = (  # the guard knows who held the descriptors
            self._accept_failures.rendezvous_note()
            if self._guard is None
            else self._guard.rendezvous_note()
        )
        return self.refused_handshakes.rendezvous_note() + accepts

    async def start(self) -> str:
        """Bind the ROUTER socket and return the endpoint it listens on."""
        self._load()
        state, machine = self._state, self._machine
        assert state is not None and machine is not None
        workers = self.config.world_size
        raise_nofile_limit()  # before the socket: each worker's connection is a file
        schedule = self.config.schedule.defaults_note() if self._attempt == 0 else None
        for note in (oslimits.nofile_note(workers), oslimits.backlog_note(workers), schedule):
            if note is not None:
                self._log(note)
        limits = connection_limits(
            workers=workers,
            timeout=self.config.heartbeat_timeout,
            frame_bytes=MAX_FRAME_BYTES,
            files=open_files(),
        )
        secured = self._security is not None
        guard = self._guard = ConnectionGuard(
            Connections(limits, self._accept_failures),
            self._log,
            self._member_closed,
            holding=hold_limits(RECEIVE_HWM, secured),
            secured=secured,
        )
        self._intake.attach(machine, guard)
        sock, self._auth = open_router(
            self._context,
            self.bind_address,
            workers=workers,
            guard=guard,
            monitor=self._monitor,
            security=self._security,
            on_refused=(
                None
                if self._security is None
                else self.refused_handshakes.reporter(asyncio.get_running_loop(), self._log)
            ),
        )
        self._socket = sock
        self._io = self._outbox.attach(sock)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        guard.bound(self.endpoint)
        machine.watchdog.phase_began(time.monotonic())
        for note in state.notes:
            self._log(note)
        if self.config.run_dir is not None and state.finished is None:
            self._start_journal(self.config.run_dir, state)
        if state.finished is None:
            self._feed.started(
                self.config, self.run_id, self.endpoint, self._attempt, state.resume_epoch
            )
        return self.endpoint

    def _close(self) -> None:
        """Close the socket (flushing the last Abort or Finish), then the authenticator."""
        if self._socket is not None:
            self._monitor.close(self._socket)
            self._outbox.detach()
            self._io = None  # a shadow: closing the socket closes it
            self._socket.close(linger=LINGER_MS)
            self._socket = None
        if self._guard is not None:
            self._guard.close()
        if self._auth is not None:  # after the socket closed
            self._auth.stop()
            self._auth = None
        if self._own_context:
            self._context.term()

    def log(self, line: str) -> None:
        """Print a line the way the service prints its own."""
        self._log(line)

    def abort(self, reason: str) -> None:
        """Ask the running service to abort the run (from the same event loop)."""
        if self._requested_abort is None:
            self._requested_abort = reason

    def heard_from_no_worker(self) -> bool:
        """Whether the rendezvous is still waiting for its first hello."""
        machine = self._machine
        return (
            machine is not None
            and machine.phase is RunPhase.RENDEZVOUS
            and not machine.rendezvous.members
        )

    def stand_down(self, line: str) -> bool:
        """The workers run a loop of their own and will never say hello (they made their process
        group themselves, as under torchrun): log ``line`` and end :meth:`run` with an empty
        summary, nothing decided. Refused (False) once a worker has said hello."""
        machine = self._machine
        if (
            machine is None
            or machine.rendezvous.members
            or machine.phase is not RunPhase.RENDEZVOUS
        ):
            return False
        self._stood_down = line
        return True

    def _member_closed(self, peer: bytes) -> None:
        if self._machine is not None:
            self._machine.connection_closed(time.monotonic(), peer)

    def worker_exited(self, pid: int, what: str, failure: str) -> bool:
        """A worker process this coordinator's launcher started (``pid``) exited (``what``: "was
        killed by SIGKILL"): in an elastic run its rank is lost and the others carry on (True);
        else the run fails, saying ``failure`` (False)."""
        machine = self._machine
        if machine is not None and machine.process_exited(time.monotonic(), pid, what):
            return True
        self.report_failure(failure, cause=True)
        return False

    def never_joined(self, pids: list[int]) -> list[int]:
        """Of ``pids`` (the launcher's workers), those the abort of a rendezvous that never
        completed cannot reach: they had not joined, so no Abort goes to them."""
        machine = self._machine
        if machine is None or machine.rendezvous.complete:
            return []
        joined = {member.hello.pid for member in machine.rendezvous.members.values()}
        return [pid for pid in pids if pid not in joined]

    def in_world(self, pid: int) -> bool:
        """Whether the worker process ``pid`` is a member of the run's world now (not lost, not
        a newcomer still starting or waiting for a boundary)."""
        machine = self._machine
        return machine is not None and any(m.hello.pid == pid for m in machine.members)

    def was_lost(self, pid: int) -> bool:
        """Whether the worker process ``pid`` was lost from the run while the others went on."""
        machine = self._machine
        return machine is not None and machine.membership.lost_pid(pid)

    def report_failure(self, what: str, *, cause: bool = False) -> None:
        """A worker failed; abort after a short settle window that lets its cause come in
        (see :meth:`RunMachine.report_failure`)."""
        self._load()
        self.machine.report_failure(time.monotonic(), what, cause=cause)

    async def run(self) -> RunSummary:
        """Serve until the run ends; return its summary or raise RunAborted."""
        if self._socket is None:
            await self.start()
        state, machine = self._state, self._machine
        assert state is not None and machine is not None
        if state.finished is not None:
            line, summary = resume.finished_summary(self.config, state.finished, self.run_id)
            self._log(line)
            self._close()
            return summary
        sock, io, guard = self._socket, self._io, self._guard
        assert sock is not None and io is not None and guard is not None
        tick = min(0.1, self.config.heartbeat_interval / 2)
        inbox = serving.open_inbox(
            io,
            read=guard.handed,  # out of libzmq: what the guard counts as no longer held there
            secured=self._security is not None,
            workers=self.config.world_size,
        )
        self._clock_read = time.monotonic()

        monitor = (
            asyncio.create_task(self._monitor.read(guard.on_event))
            if self._monitor.watching
            else None
        )
        try:
            while self._outcome is None:
                if inbox:  # frames read out already are handed on without waiting for more,
                    # after the loop's other tasks had their turn (the monitor's reader: libzmq's
                    # I/O thread stops while the monitor's pipe is full)
                    await asyncio.sleep(0)
                polled = await sock.poll(timeout=0 if inbox else int(tick * 1000))
                await self._read_clock(tick)  # before any frame: a stopped process blames nobody
                drained = not polled  # every finished message read: the guard's tighter bound
                if (polled or inbox) and self._outcome is None:
                    # a bounded batch, so a flood cannot starve heartbeats and the clock
                    drained = await serving.hand_on(inbox, self._hand, drained=drained)
                now = await self._read_clock(serving.BATCH_SECONDS)
                guard.tick(now, drained)  # after the queued frames: a hello read in time is in time
                if self._outcome is not None:
                    break
                if self._requested_abort is not None:
                    await self._apply(machine.abort(self._requested_abort))
                    break
                if self._stood_down is not None:
                    self._log(self._stood_down)
                    self._outcome = RunSummary(self.run_id, None, None, 0)
                    break
                await self._apply(machine.on_tick(now))
                self._upkeep.say_failures()
        finally:
            if monitor is not None:
                monitor.cancel()  # no await before the monitor is disabled: it drains till then
            self._ended = True
            for dropped in (machine.gate.summary(), guard.summary()):
                if dropped is not None:
                    self._log(dropped)
            if self._journal is not None:
                self._journal.close()
            self._close()
            if monitor is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await monitor
        await self._upkeep.finish()
        if isinstance(self._outcome, RunAborted):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    # ------------------------------------------------------------------ applying

    async def _hand(self, frames: list[Any], now: float) -> bool:
        """One received message (routing id, frame) handed to the machine, its actions done;
        whether the run has ended with them."""
        actions = self._intake.receive(frames, now)
        if actions:  # most frames (heartbeats) change nothing to carry out or tell
            await self._apply(actions)
        self._intake.answered(now)
        return self._outcome is not None

    async def _apply(self, actions: list[Action]) -> None:
        """Carry out ``actions``, then tell the observers what they changed."""
        await self._carry_out(actions)
        self._tell_observers()

    async def _carry_out(self, actions: list[Action]) -> None:
        """Carry out ``actions`` in order; a record that cannot be written stops the rest and the
        run (progress that is not recorded cannot be resumed)."""
        for action in actions:
            try:
                await self._do(action)
            except JournalError as exc:
                await self._carry_out(self.machine.unrecorded(self._unwritten(exc)))
                return

    async def _do(self, action: Action) -> None:
        match action:
            case Send(peer=peer, message=message):
                await self._outbox.send(peer, message)
            case Broadcast(peers=peers, message=message):
                await self._outbox.broadcast(peers, message)
                if isinstance(message, Heartbeat):
                    self._feed.heartbeat_sent()
            case Log(line=line):
                self._log(line)
            case Journal():
                self._write(action)
            case Prune(epochs=epochs):
                checkpoint_dir = self.config.checkpoint_path
                assert checkpoint_dir is not None
                self._upkeep.prune(checkpoint_dir, epochs)
            case Finished(summary=summary):
                self._outcome = summary
            case Aborted(reason=reason, needs_fix=needs_fix):
                self._outcome = RunAborted(reason, needs_fix=needs_fix)

    # ------------------------------------------------------------------ the clock

    async def _read_clock(self, step: float) -> float:
        """Now; first moving every deadline past any time the service itself was not running."""
        now = time.monotonic()
        lost = clock.lost_time(self._clock_read, now, step)
        self._clock_read = now
        if lost > 0:
            if self._guard is not None:
                self._guard.forgive(lost)
            await self._apply(self.machine.lost_time(now, lost))
        return now
