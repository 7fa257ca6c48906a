"""The coordinator service: one ZeroMQ ROUTER socket and one asyncio task that moves messages.

It receives a frame, decodes it, hands it to the pure logic (:mod:`.rendezvous`, :mod:`.policy`,
:mod:`.liveness`) and sends what that decided. Every decision all ranks must share is taken here,
once. The service never imports torch.

Phases, in order: rendezvous -> store (rank 0 opens the data-plane store) -> ready (every rank
announces its batches, answered by Go) -> running (every rank reports losses, answered by
Decision) -> back to ready, or finishing (Finish sent, waiting for every Done) -> ended.
An abort from any phase sends Abort to every worker and ends the run with RunAborted.
"""

from __future__ import annotations

import asyncio
import enum
import math
import os
import shutil
import socket
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from epochal.coordinator import clock, liveness, resume
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.journal import Journal, JournalError
from epochal.coordinator.policy import (
    BatchCounts,
    EpochOutcome,
    EpochPlan,
    LossSums,
    PolicyViolation,
    plan_epoch,
)
from epochal.coordinator.policy import aggregate as aggregate_losses
from epochal.coordinator.rendezvous import (
    Admitted,
    Fatal,
    Member,
    Refused,
    Rendezvous,
    printable,
)
from epochal.coordinator.sessions import Sessions
from epochal.errors import MalformedMessage, ProtocolVersionMismatch, RunAborted
from epochal.manifest import checkpoint_path
from epochal.protocol import (
    MAX_FRAME_BYTES,
    Abort,
    Checkpointed,
    CoordinatorMessage,
    Decision,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Finish,
    Go,
    Heartbeat,
    Hello,
    Joined,
    Message,
    OpenStore,
    Reject,
    Status,
    StoreReady,
    Welcome,
    clip,
    encode,
)
from epochal.protocol.codec import decode_frame
from epochal.protocol.messages import Phase as WorkerPhase
from epochal.protocol.messages import check_phase
from epochal.security.curve import RefusedHandshakes, ServerSecurity, secure_server

REFUSALS_LOGGED = 20
"""Refused hellos logged per minute; the rest are counted."""

BATCH = 256
"""Frames handled before the service looks at its clock again."""

BATCH_SECONDS = 0.05
"""Longest a batch of frames may keep the service from its clock (one frame may overrun it)."""

STRANGER_REPLIES = 8
"""Rejections a peer outside the run gets before its frames are dropped unanswered."""

MAX_STRANGERS = 4096
"""Peers outside the run whose rejections are counted; the least recent are forgotten."""

RECEIVE_HWM = 64
"""Frames queued per peer before libzmq drops more: bounds what one peer can make us hold."""

FAILURE_SETTLE = 0.25
"""Seconds between the first failure report and the abort, so the cause can arrive too."""

LINGER_MS = 2000
"""How long closing the socket may wait to flush the last Abort or Finish."""


class Phase(enum.Enum):
    RENDEZVOUS = "rendezvous"
    STORE = "store"
    READY = "ready"
    RUNNING = "running"
    FINISHING = "finishing"
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class RunSummary:
    """How a finished run went, as the coordinator saw it."""

    run_id: str
    best_epoch: int | None
    best_loss: float | None
    epochs_run: int
    history: list[EpochOutcome] = field(default_factory=list)


def _format_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_epoch_line(outcome: EpochOutcome, epochs: int, lr_factor: float, seconds: float) -> str:
    """The one line per epoch a person follows a run by."""
    best = (
        "-"
        if outcome.best_epoch is None
        else f"{outcome.best_epoch} ({_format_loss(outcome.best_loss)})"
    )
    marker = " *" if outcome.is_best else ""
    return (
        f"epoch {outcome.epoch} [{outcome.epoch + 1}/{epochs}]  "
        f"train {_format_loss(outcome.train_loss)}  valid {_format_loss(outcome.valid_loss)}  "
        f"smoothed {_format_loss(outcome.smoothed_loss)}  lr x{lr_factor:g}  best {best}  "
        f"{seconds:.2f}s{marker}"
    )


def _readable(sock: zmq.asyncio.Socket) -> bool:
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def new_run_id() -> str:
    """A fresh, short, unique run id."""
    return uuid.uuid4().hex[:12]


def _user_id(frame: Any) -> str:
    """The ZAP user id (under CURVE: the sender's public key) of a received frame; "" without."""
    if isinstance(frame, bytes):
        return ""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:  # no security mechanism on this connection: no user id
        return ""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Coordinator:
    """Runs one training job's control plane.

    ``await start()`` binds and returns the endpoint (port 0 is resolved), ``await run()`` serves
    until the run finishes (returns a RunSummary) or is aborted (raises RunAborted).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        bind: str = "tcp://127.0.0.1:0",
        log: Callable[[str], None] = _stderr,
        context: zmq.asyncio.Context | None = None,
        run_id: str | None = None,
        fresh: bool = False,
        security: ServerSecurity | None = None,
    ) -> None:
        self.config = config
        self.bind_address = bind
        self.endpoint: str | None = None
        self.run_id = run_id or new_run_id()
        self.phase = Phase.RENDEZVOUS
        self._log = log
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
        self._rendezvous = Rendezvous(config)
        self._last_seen: dict[bytes, float] = {}
        self._ranks: dict[bytes, int] = {}
        self._members_by_rank: list[Member] = []
        self._rehello_logged: dict[int, float] = {}
        self._stall: tuple[float, float] | None = None
        # the latest time this coordinator was not running: (seconds lost, when it ran again)
        # when each rank's hello in the middle of the run was last logged
        self._backend = "gloo"
        self._store: StoreReady | None = None
        self._epoch = 0
        self._ready: dict[int, BatchCounts] = {}
        self._reports: dict[int, LossSums] = {}
        self._done: set[int] = set()
        self._plan: EpochPlan | None = None
        self._validates = False
        self._checkpoint_dir = config.checkpoint_path
        if fresh:
            resume.start_fresh(config, self._checkpoint_dir)
        self._state = resume.inspect(config, self._checkpoint_dir)
        self._loop = self._state.loop
        self._committed = [r["epoch"] for r in self._state.records if r["kind"] == "checkpoint"]
        self._epoch = self._state.start_epoch
        self._phase_started = 0.0
        self._epoch_started = 0.0
        self._requested_abort: str | None = None
        self._failures: list[tuple[int, str]] = []
        # (priority, what) reported in the settle window before an abort; a process exit (0)
        # is the cause, a rank's error after it (1) usually its consequence
        self._failure_deadline: float | None = None
        self._status: dict[int, tuple[str, int, int, float]] = {}
        # rank -> (phase, epoch, step, when that last changed)
        self._where: dict[int, str] = {}
        # rank -> the line its training code was at in its last heartbeat
        self._stall_reported = 0.0
        self._outcome: RunSummary | RunAborted | None = None
        self._journal: Journal | None = None
        self.dropped_frames = 0
        # frames that could not be read (malformed, oversized, another protocol version)
        self.ignored_frames = 0
        # frames from strangers past their reply budget, dropped without an answer
        self._strangers: OrderedDict[bytes, int] = OrderedDict()
        self._sessions = Sessions()
        self.forged_frames = 0
        # frames under a member's routing identity without its session (or key): never acted on
        self._refusal_window = 0.0
        self._refusals_shown = 0
        self._refusals_hidden = 0
        self._clock_read = time.monotonic()
        # the last reading of the service's clock (see clock.lost_time)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Bind the ROUTER socket and return the endpoint it listens on."""
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        if self._security is not None:
            try:  # the authenticator runs before the socket binds: nobody slips in unchecked
                self._auth = secure_server(
                    self._context,
                    sock,
                    self._security,
                    on_refused=self.refused_handshakes.reporter(
                        asyncio.get_running_loop(), self._log
                    ),
                )
            except BaseException:
                sock.close(linger=0)
                raise
        try:
            sock.bind(self.bind_address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._stop_auth()
            raise OSError(f"cannot bind the coordinator to {self.bind_address}: {exc}") from None
        self._socket = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._phase_started = time.monotonic()
        for note in self._state.notes:
            self._log(note)
        if self.config.run_dir is not None and self._state.finished is None:
            self._journal = Journal(self.config.run_dir)
            self._journal.rewrite(self._state.records)
            self._journal.start(
                {
                    "run_id": self.run_id,
                    "endpoint": self.endpoint,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "started": time.time(),
                    "resumed_from": self._state.resume_epoch,
                    "config": resume.config_record(self.config),
                }
            )
            if self._state.resume_epoch is not None:
                self._log(
                    f"resuming {self.config.run_dir} at epoch {self._epoch} from the checkpoint of "
                    f"epoch {self._state.resume_epoch} (best so far: epoch {self._loop.best_epoch})"
                )
        return self.endpoint

    @property
    def finished(self) -> dict[str, Any] | None:
        """result.json of a run directory whose run already finished (nothing left to train)."""
        return self._state.finished

    def _stop_auth(self) -> None:
        """Stop the authenticator (after the socket closed)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def log(self, line: str) -> None:
        """Print a line the way the service prints its own."""
        self._log(line)

    def abort(self, reason: str) -> None:
        """Ask the running service to abort the run (from the same event loop)."""
        if self._requested_abort is None:
            self._requested_abort = reason

    def report_failure(self, what: str, *, cause: bool = False) -> None:
        """A worker failed; abort after a short settle window that lets its cause come in.

        ``cause`` marks a fact such as a worker process exiting, which goes first in the reason:
        when a rank dies, the others' collectives fail a moment later, and their errors are
        consequences.
        """
        self._failures.append((0 if cause else 1, what))
        if self._failure_deadline is None:
            self._failure_deadline = time.monotonic() + FAILURE_SETTLE

    async def run(self) -> RunSummary:
        """Serve until the run ends; return its summary or raise RunAborted."""
        if self._socket is None:
            await self.start()
        done = self._state.finished
        if done is not None:
            self._log(
                f"the run in {self.config.run_dir} already finished (best epoch "
                f"{done.get('best_epoch')}); nothing to train. Pass --fresh to train it again"
            )
            return RunSummary(
                run_id=str(done.get("run_id", self.run_id)),
                best_epoch=done.get("best_epoch"),
                best_loss=done.get("best_loss"),
                epochs_run=int(done.get("epochs_run", 0)),
            )
        sock = self._socket
        assert sock is not None
        tick = min(0.1, self.config.heartbeat_interval / 2)
        next_heartbeat = time.monotonic()
        self._clock_read = next_heartbeat
        try:
            while self._outcome is None:
                polled = await sock.poll(timeout=int(tick * 1000))
                self._read_clock(tick)  # before any frame: a stopped process blames nobody
                if polled:
                    # a bounded batch, so a flood cannot starve heartbeats and the clock
                    batch_end = time.monotonic() + BATCH_SECONDS
                    for _ in range(BATCH):
                        if self._outcome is not None or not _readable(sock):
                            break
                        frames = await sock.recv_multipart(copy=False)
                        try:
                            await self._receive(frames)
                        except JournalError as exc:
                            await self._unrecorded(exc)
                        if time.monotonic() > batch_end:
                            break
                now = self._read_clock(BATCH_SECONDS)
                if self._requested_abort is not None and self._outcome is None:
                    await self._abort(self._requested_abort)
                    break
                if now >= next_heartbeat:
                    next_heartbeat = now + self.config.heartbeat_interval
                    await self._broadcast_heartbeat()
                try:
                    await self._check_clock(now)
                except JournalError as exc:
                    await self._unrecorded(exc)
        finally:
            self.phase = Phase.ENDED
            if self.dropped_frames or self.ignored_frames or self.forged_frames:
                self._log(
                    f"dropped {self.dropped_frames} unreadable frames and ignored "
                    f"{self.ignored_frames} more from peers outside the run"
                    + (
                        f" and {self.forged_frames} sent under a worker's identity without its "
                        "session"
                        if self.forged_frames
                        else ""
                    )
                )
            if self._journal is not None:
                self._journal.close()
            sock.close(linger=LINGER_MS)
            self._socket = None
            self._stop_auth()
            if self._own_context:
                self._context.term()
        if isinstance(self._outcome, RunAborted):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    # ------------------------------------------------------------------ sending

    async def _send(self, peer: bytes, message: CoordinatorMessage) -> None:
        assert self._socket is not None
        await self._socket.send_multipart([peer, encode(message)])

    def _log_refusal(self, line: str) -> None:
        """Log refusals, but at most REFUSALS_LOGGED a minute: a flood must not flood the log."""
        now = time.monotonic()
        if now - self._refusal_window > 60:
            if self._refusals_hidden:
                self._log(f"... and {self._refusals_hidden} more refusals in that minute")
            self._refusal_window, self._refusals_shown, self._refusals_hidden = now, 0, 0
        if self._refusals_shown < REFUSALS_LOGGED:
            self._refusals_shown += 1
            self._log(line)
        else:
            self._refusals_hidden += 1

    async def _reject(self, peer: bytes, reason: str, code: str) -> None:
        """Answer a peer that is not in the run, a few times; after that, drop it silently.

        A misconfigured worker gets its explanation; a peer that keeps sending junk cannot make
        the coordinator do unbounded work or hold unbounded state (at most MAX_STRANGERS counted).
        """
        sent = self._strangers.pop(peer, 0)
        self._strangers[peer] = sent + 1  # most recent last
        if len(self._strangers) > MAX_STRANGERS:
            self._strangers.popitem(last=False)
        if sent >= STRANGER_REPLIES:
            self.ignored_frames += 1
            return
        await self._send(peer, Reject(reason=clip(reason), code=code))

    async def _send_all(self, message: CoordinatorMessage) -> None:
        data = encode(message)
        assert self._socket is not None
        for member in self._members_by_rank or list(self._rendezvous.members.values()):
            await self._socket.send_multipart([member.peer, data])

    async def _broadcast_heartbeat(self) -> None:
        await self._send_all(Heartbeat())

    # ------------------------------------------------------------------ receiving

    async def _receive(self, frames: list[Any]) -> None:
        if len(frames) != 2:
            self.dropped_frames += 1
            return
        peer = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        data = frames[1] if isinstance(frames[1], bytes) else frames[1].buffer  # not copied
        user_id = _user_id(frames[1])
        member = peer in self._sessions
        if not member and self._strangers.get(peer, 0) >= STRANGER_REPLIES:
            self.ignored_frames += 1  # its budget is spent: not even read
            return
        try:
            message, session = decode_frame(data)
        except ProtocolVersionMismatch as exc:
            self.dropped_frames += 1
            await self._reject(peer, str(exc), "version")
            return
        except MalformedMessage as exc:
            self.dropped_frames += 1
            rank = self._ranks.get(peer)
            if rank is not None and self._sessions.same_sender(peer, user_id):
                await self._abort(f"rank {rank} sent a malformed message: {exc}")
            else:
                await self._reject(peer, f"malformed message: {exc}", "malformed")
            return
        forged = not isinstance(message, Hello) and not self._sessions.check(peer, session, user_id)
        if member and forged:
            if session or not isinstance(message, Heartbeat | Status):
                self._forged(peer, message)
            # a heartbeat without a session may cross the Joined that carries it: dropped quietly
            return
        if peer in self._last_seen or peer in self._ranks:
            self._last_seen[peer] = time.monotonic()
        await self._handle(peer, message, user_id)

    def _forged(self, peer: bytes, message: Message) -> None:
        """A frame under a member's identity without its session: never acted on."""
        self.forged_frames += 1
        if isinstance(message, Heartbeat | Status):
            return  # harmless to the run: counted, not logged
        who = self._rendezvous.members.get(peer)
        self._log_refusal(
            f"dropped a {type(message).__name__} sent as "
            f"{who.describe() if who is not None else 'a worker'} without its session: another "
            "process is using that worker's identity (its frames are ignored)"
        )

    async def _handle(self, peer: bytes, message: Message, user_id: str = "") -> None:
        if isinstance(message, Hello):
            await self._on_hello(peer, message, user_id)
            return
        rank = self._ranks.get(peer)
        if rank is None:
            if peer in self._rendezvous.members:
                if isinstance(message, Heartbeat | Status):
                    return
                if isinstance(message, Failed):
                    member = self._rendezvous.members[peer]
                    self._log(
                        f"{member.describe()} failed before the run started: {message.reason}"
                    )
                    self._rendezvous.leave(peer)
                    self._sessions.forget(peer)
                    self._last_seen.pop(peer, None)
                    return
            if not isinstance(message, Heartbeat | Status):
                await self._send(
                    peer,
                    Reject(reason="not a member of this run: send hello first", code="not_member"),
                )
            return
        match message:
            case Heartbeat():
                pass
            case Status():
                self._note_status(rank, message)
            case StoreReady() if self.phase is Phase.STORE and rank == 0:
                self._store = message
                await self._welcome_all()
            case EpochReady() if self.phase is Phase.READY and message.epoch == self._epoch:
                self._ready[rank] = BatchCounts(message.train_batches, message.valid_batches)
                if len(self._ready) == self.config.world_size:
                    await self._start_epoch()
            case EpochReport() if self.phase is Phase.RUNNING and message.epoch == self._epoch:
                self._reports[rank] = LossSums(
                    message.train_loss_sum,
                    message.train_count,
                    message.valid_loss_sum,
                    message.valid_count,
                )
                if len(self._reports) == self.config.world_size:
                    await self._decide()
            case Checkpointed() if rank == 0 and message.epoch <= self._epoch:
                self._on_checkpointed(message.epoch)
            case Done() if self.phase is Phase.FINISHING:
                self._done.add(rank)
                if len(self._done) == self.config.world_size:
                    self._end()
            case Failed():
                member = self._members_by_rank[rank]
                self.report_failure(self._failed_line(rank, member, message.reason))
            case _:
                await self._abort(
                    f"rank {rank} sent {type(message).__name__} while the coordinator was in "
                    f"phase {self.phase.value} of epoch {self._epoch}: the worker and coordinator "
                    "are out of step (a bug, or mixed epochal versions)"
                )

    async def _on_hello(self, peer: bytes, hello: Hello, user_id: str = "") -> None:
        if not self._sessions.same_sender(peer, user_id):
            self.forged_frames += 1
            self._log_refusal(
                f"refused a hello as {printable(hello.worker_id)}: its connection is bound to "
                "another worker's key"
            )
            return
        verdict = self._rendezvous.offer(peer, hello)
        match verdict:
            case Refused(reason=reason):
                self._log_refusal(
                    f"refused worker {printable(hello.worker_id)} from {printable(hello.host)}: "
                    f"{reason}"
                )
                await self._reject(peer, reason, "refused")
            case Fatal(reason=reason):
                await self._send(peer, Abort(reason=clip(reason)))
                await self._abort(reason)
            case Admitted(again=again):
                self._last_seen[peer] = time.monotonic()
                session = self._sessions.issue(peer, user_id)
                joined = len(self._rendezvous.members)
                if again and peer in self._ranks:
                    if self._store is not None:
                        await self._send(peer, self._welcome_for(peer))
                        self._note_rehello(self._ranks[peer])
                    return
                await self._send(
                    peer,
                    Joined(joined=joined, world_size=self.config.world_size, session=session),
                )
                if again:
                    return
                self._log(
                    f"worker {printable(hello.worker_id)} joined from {printable(hello.host)} "
                    f"({joined}/{self.config.world_size})"
                )
                if self._rendezvous.complete:
                    await self._open_store()

    def _failed_line(self, rank: int, member: Member, reason: str) -> str:
        """How a rank's Failed reads; one sent while this coordinator was not running says so.

        A worker that heard nothing from the coordinator for its own heartbeat timeout and may
        not re-attach stops, telling why; a coordinator that was stopped reads that on waking.
        """
        line = f"rank {rank} ({member.describe()}) failed: {reason}"
        stall = self._stall
        if stall is not None and time.monotonic() - stall[1] <= self.config.heartbeat_timeout:
            self._stall = None  # said once, before the first such failure
            line = (
                f"this coordinator was not running for {stall[0]:.1f} s (its process was stopped, "
                f"or the machine suspended or overloaded), and meanwhile {line}"
            )
        return line

    def _note_rehello(self, rank: int) -> None:
        """Log (once per heartbeat timeout) a rank saying hello again in the middle of the run."""
        now = time.monotonic()
        if now - self._rehello_logged.get(rank, -math.inf) < self.config.heartbeat_timeout:
            return
        self._rehello_logged[rank] = now
        self._log(
            f"rank {rank} ({self._members_by_rank[rank].describe()}) said hello again: it heard "
            "nothing from this coordinator for its own heartbeat timeout (was the coordinator "
            "not running?) and re-attached; it carries on where it was"
        )

    # ------------------------------------------------------------------ phases

    async def _open_store(self) -> None:
        self._ranks, self._backend = self._rendezvous.assign()
        members = self._rendezvous.members
        by_rank: list[Member | None] = [None] * self.config.world_size
        for peer, rank in self._ranks.items():
            by_rank[rank] = members[peer]
        self._members_by_rank = [m for m in by_rank if m is not None]
        if self.config.run_dir is not None:
            fingerprint = self._members_by_rank[0].hello.fingerprint
            problem = resume.check_model(self.config.run_dir, fingerprint)
            if problem is not None:
                await self._abort(problem)
                return
        self._set_phase(Phase.STORE)
        await self._send(self._members_by_rank[0].peer, OpenStore(run_id=self.run_id))

    def _welcome_for(self, peer: bytes) -> Welcome:
        assert self._store is not None
        return Welcome(
            rank=self._ranks[peer],
            world_size=self.config.world_size,
            run_id=self.run_id,
            backend=self._backend,
            store_host=self._store.host,
            store_port=self._store.port,
            start_epoch=self._state.start_epoch,
            epochs=self.config.epochs,
            resume_epoch=self._state.resume_epoch,
            checkpoint_dir=str(self._checkpoint_dir or ""),
            session=self._sessions.issue(peer, ""),
            store_key=self._store.key,
        )

    async def _welcome_all(self) -> None:
        for member in self._members_by_rank:
            await self._send(member.peer, self._welcome_for(member.peer))
        self._log(
            f"run {self.run_id}: {self.config.world_size} workers, backend {self._backend}, "
            f"data-plane store at {self._store.host}:{self._store.port}"  # type: ignore[union-attr]
        )
        for rank, member in enumerate(self._members_by_rank):
            hello = member.hello
            self._log(f"rank {rank}: {hello.host}, data plane at {hello.data_address or '?'}")
        self._set_phase(Phase.READY)

    async def _start_epoch(self) -> None:
        if self._loop.history and self._loop.history[-1].stop:
            self._ready.clear()  # resumed after the last decision: only the finish is left
            await self._finish()
            return
        try:
            plan = plan_epoch(self._ready, self.config.batch_policy)
        except PolicyViolation as exc:
            await self._abort(f"epoch {self._epoch}: {exc}")
            return
        self._validates = plan.valid_batches > 0  # every rank has validation data
        validate_now = self._validates and self.config.validates(self._epoch)
        self._plan = EpochPlan(plan.train_batches, plan.valid_batches if validate_now else 0)
        self._ready.clear()
        self._set_phase(Phase.RUNNING)
        self._epoch_started = time.monotonic()
        await self._send_all(
            Go(
                epoch=self._epoch,
                train_batches=self._plan.train_batches,
                valid_batches=self._plan.valid_batches,
                lr_factor=self._loop.lr_factor,
            )
        )

    async def _decide(self) -> None:
        try:
            train_loss, valid_loss = aggregate_losses(self._reports)
        except PolicyViolation as exc:
            await self._abort(f"epoch {self._epoch}: {exc}")
            return
        self._reports.clear()
        outcome = self._loop.update(self._epoch, train_loss, valid_loss, validates=self._validates)
        checkpoint = self._checkpoint_dir is not None and (
            self.config.checkpoints(outcome.epoch, last=outcome.stop)
            or (outcome.is_best and self.config.checkpoint_every > 0)
        )
        seconds = time.monotonic() - self._epoch_started
        if self._journal is not None:
            plan = self._plan
            assert plan is not None
            self._journal.epoch(
                {
                    "kind": "epoch",
                    **asdict(outcome),
                    "validates": self._validates,
                    "checkpoint": checkpoint,
                    "train_batches": plan.train_batches,
                    "valid_batches": plan.valid_batches,
                    "seconds": round(seconds, 6),
                    "time": time.time(),
                }
            )
        await self._send_all(
            Decision(
                epoch=outcome.epoch,
                train_loss=outcome.train_loss,
                valid_loss=outcome.valid_loss,
                smoothed_loss=outcome.smoothed_loss,
                best_epoch=outcome.best_epoch,
                is_best=outcome.is_best,
                checkpoint=checkpoint,
                stop=outcome.stop,
            )
        )
        self._log(format_epoch_line(outcome, self.config.epochs, outcome.lr_factor, seconds))
        if outcome.stop:
            if outcome.stop_reason == "lr_factor":
                self._log(f"the learning-rate factor reached {outcome.next_lr_factor:g}: stopping")
            elif outcome.stop_reason == "patience":
                self._log(
                    f"no improvement for {self._loop.stale} validated epochs "
                    f"(patience {self.config.patience}): stopping early"
                )
            await self._finish()
        else:
            self._epoch += 1
            self._set_phase(Phase.READY)

    def _on_checkpointed(self, epoch: int) -> None:
        if self._journal is not None:
            self._journal.epoch({"kind": "checkpoint", "epoch": epoch, "time": time.time()})
        self._committed.append(epoch)
        if self._checkpoint_dir is not None:
            pruned = resume.prunable(
                self._committed, self.config.keep_checkpoints, self._loop.best_epoch
            )
            for old in pruned:
                shutil.rmtree(checkpoint_path(self._checkpoint_dir, old), ignore_errors=True)
            self._committed = [e for e in self._committed if e not in pruned]

    async def _finish(self) -> None:
        loop = self._loop
        await self._send_all(
            Finish(
                best_epoch=loop.best_epoch,
                best_loss=loop.best_loss,
                epochs_run=len(loop.history),
                restore_best=self.config.restore_best,
            )
        )
        self._log(
            f"run {self.run_id} finished after {len(loop.history)} epochs: best epoch "
            f"{loop.best_epoch} (smoothed loss {_format_loss(loop.best_loss)})"
        )
        self._set_phase(Phase.FINISHING)

    def _end(self) -> None:
        loop = self._loop
        summary = RunSummary(
            run_id=self.run_id,
            best_epoch=loop.best_epoch,
            best_loss=loop.best_loss,
            epochs_run=len(loop.history),
            history=list(loop.history),
        )
        if self._journal is not None:
            self._journal.result(
                {
                    "status": "finished",
                    "run_id": self.run_id,
                    "best_epoch": loop.best_epoch,
                    "best_loss": loop.best_loss,
                    "epochs_run": len(loop.history),
                }
            )
        self._outcome = summary

    async def _abort(self, reason: str) -> None:
        if self._outcome is not None:
            return
        self._log(f"run aborted: {reason}")
        await self._send_all(Abort(reason=clip(reason)))
        if self._journal is not None:
            try:
                self._journal.result({"status": "aborted", "run_id": self.run_id, "reason": reason})
            except JournalError as exc:
                self._log(f"the abort is not recorded in the run directory: {exc}")
        self._outcome = RunAborted(reason)

    async def _unrecorded(self, exc: JournalError) -> None:
        """The run directory cannot be written: stop, since progress that is not recorded
        cannot be resumed (and a decision is never sent before its record is durable)."""
        await self._abort(f"{exc}; the run stops because it cannot record its progress")

    def _note_status(self, rank: int, status: Status) -> None:
        now = time.monotonic()
        before = self._where.get(rank)
        self._where[rank] = status.where
        previous = self._status.get(rank)
        if (
            previous is None
            or (previous[0], previous[1], previous[2]) != (status.phase, status.epoch, status.step)
            or liveness.moved(before, status.where)
        ):
            self._status[rank] = (status.phase, status.epoch, status.step, now)

    def _lost_message(self, now: float) -> str | None:
        """A rank that says it is waiting for us although its message never arrived.

        Only a wait first seen after the current phase began counts, and only after a margin of
        several heartbeats, so a slow or starved heartbeat thread never looks like a loss.
        """
        have: set[int]
        if self.phase is Phase.READY:
            have, what, answer = set(self._ready), "batch counts", "Go"
        elif self.phase is Phase.RUNNING:
            have, what, answer = set(self._reports), "loss report", "decision"
        else:
            return None
        margin = max(3 * self.config.heartbeat_interval, 2.0)
        for rank in range(self.config.world_size):
            status = self._status.get(rank)
            if rank in have or status is None:
                continue
            phase, epoch, _, since = status
            waiting = phase == "waiting" and epoch == self._epoch
            member = self._members_by_rank[rank]
            # heard from for longer than the margin while it waits: its link works, so the message
            # was lost; a rank that went silent meanwhile is the heartbeat timeout's to name
            heard = self._last_seen.get(member.peer, since)
            if waiting and since > self._phase_started and heard - since > margin:
                return (
                    f"rank {rank} ({member.describe()}) has waited {now - since:.1f} s for "
                    f"epoch {epoch}'s {answer}, but its {what} never arrived: a control "
                    "message was lost (a faulty link or proxy, or a bug), and the ranks "
                    "cannot agree on this epoch without it"
                )
        return None

    def _stall_report(self, now: float) -> str:
        return liveness.stall_table(self._rows(now))

    def _rows(self, now: float) -> list[tuple[int, str, str, int, int, float, str]]:
        rows = []
        for rank, member in enumerate(self._members_by_rank):
            phase, epoch, step, since = self._status.get(rank, ("?", 0, 0, self._phase_started))
            where = self._where.get(rank, "")
            rows.append((rank, member.hello.host, phase, epoch, step, now - since, where))
        return rows

    def _doing(self, rank: int) -> str:
        """What ``rank`` last said it was doing (" while connecting the data plane"), or ""."""
        status = self._status.get(rank)
        phase = WorkerPhase.RENDEZVOUS if status is None else check_phase(status[0])
        if phase is WorkerPhase.RENDEZVOUS and self._store is not None:
            phase = WorkerPhase.CONNECT  # welcomed: a worker connects its data plane next
        return f" while {phase.description}"

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self._phase_started = time.monotonic()

    # ------------------------------------------------------------------ the clock

    def _read_clock(self, step: float) -> float:
        """Now; first moving every deadline past any time the service itself was not running."""
        now = time.monotonic()
        lost = clock.lost_time(self._clock_read, now, step)
        self._clock_read = now
        if lost > 0:
            self._forgive(lost)
        return now

    def _forgive(self, lost: float) -> None:
        """Give every rank a fresh window: for ``lost`` seconds nobody here could hear them."""
        self._last_seen = {peer: seen + lost for peer, seen in self._last_seen.items()}
        self._status = {
            rank: (phase, epoch, step, since + lost)
            for rank, (phase, epoch, step, since) in self._status.items()
        }
        self._phase_started += lost
        self._stall_reported += lost
        if self._failure_deadline is not None:
            self._failure_deadline += lost
        self._stall = (lost, time.monotonic())
        if lost > self.config.heartbeat_interval:
            self._log(
                f"the coordinator itself was not running for {lost:.1f} s (its process was "
                "stopped, or the machine suspended or overloaded): no rank is blamed for that "
                "silence"
            )

    async def _check_clock(self, now: float) -> None:
        if self._outcome is not None:
            return
        if self._failure_deadline is not None and now >= self._failure_deadline:
            ordered = [what for _, what in sorted(self._failures, key=lambda f: f[0])]
            await self._abort("; then ".join(ordered))
            return
        cfg = self.config
        waited = now - self._phase_started
        if self.phase is Phase.RENDEZVOUS:
            for peer in liveness.lost(now, self._last_seen, cfg.heartbeat_timeout):
                member = self._rendezvous.members.get(peer)
                if member is not None:
                    self._log(f"{member.describe()} went silent during rendezvous; dropped")
                    self._rendezvous.leave(peer)
                    self._sessions.forget(peer)
                self._last_seen.pop(peer, None)
            if waited > cfg.rendezvous_timeout:
                joined = len(self._rendezvous.members)
                await self._abort(
                    f"only {joined} of {cfg.world_size} workers joined within "
                    f"{cfg.rendezvous_timeout:g} s: start the missing workers, or lower "
                    f"--world-size{self.refused_handshakes.rendezvous_note()}"
                )
            return
        if self.phase is Phase.STORE and waited > cfg.store_timeout:
            await self._abort(
                f"rank 0 ({self._members_by_rank[0].describe()}) did not open the data-plane "
                f"store within {cfg.store_timeout:g} s"
            )
            return
        if self.phase in (Phase.READY, Phase.RUNNING) and self._status:
            newest = max(entry[3] for entry in self._status.values())
            if now - newest > cfg.stall_timeout and now - self._stall_reported > cfg.stall_timeout:
                self._stall_reported = now
                self._log(
                    f"no rank has made progress for {now - newest:.0f} s "
                    f"(--stall-timeout {cfg.stall_timeout:g}); where each rank is:\n"
                    + self._stall_report(now)
                )
            rows = [liveness.Progress(r, p, e, s, t, w) for r, _, p, e, s, t, w in self._rows(now)]
            stuck = liveness.stalled(rows, cfg.stall_abort)
            if stuck is not None:
                member = self._members_by_rank[stuck.rank]
                await self._abort(f"{stuck.reason} [rank {stuck.rank}: {member.describe()}]")
                return
        lost = self._lost_message(now)
        if lost is not None:
            await self._abort(lost)
            return
        ranked = {peer: self._last_seen.get(peer, now) for peer in self._ranks}
        silent = liveness.lost(now, ranked, cfg.heartbeat_timeout)
        if silent:
            rank = self._ranks[silent[0]]
            member = self._members_by_rank[rank]
            await self._abort(
                f"rank {rank} ({member.describe()}) sent nothing for "
                f"{now - ranked[silent[0]]:.1f} s{self._doing(rank)}: it died, hung or lost its "
                "network"
            )
            return
        if self.phase is Phase.FINISHING and waited > cfg.finish_timeout:
            missing = sorted(set(range(cfg.world_size)) - self._done)
            self._log(f"ranks {missing} did not confirm the finish within {cfg.finish_timeout:g} s")
            self._end()
