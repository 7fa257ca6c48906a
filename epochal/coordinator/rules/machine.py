"""The run's phase machine: every decision all ranks must share, as a pure function of the clock.

:class:`RunMachine` takes ``now`` and what arrived (:meth:`~RunMachine.on_message`), or just ``now``
(:meth:`~RunMachine.on_tick`), and returns the :mod:`actions <epochal.coordinator.rules.actions>`
that follow: messages to send, records to write, lines to log, the end of the run. It opens no
socket, reads no clock and touches no file (the run directory's model record is handed in), so a
whole run is driven by a test with a clock it sets (``tests/coordinator/test_machine.py``).

The machine is thin: it holds the run's facts in one :class:`~.machinestate.MachineState` and
routes each message and tick to the part that owns its concern, each given the state (and, by
reference, the parts it hands work on to):
:mod:`.joining` (hellos, the store, the welcome), :mod:`.regrouping` (a lost rank, a new world),
:mod:`.takeback` (running workers taken back by a restarted coordinator), :mod:`.epochs` (each
epoch's Go and decision) and :mod:`.finishing` (checkpoints committed, the Finish, the result).
The clock rules themselves are in :mod:`.watchdog`, the budget of peers outside the run in
:mod:`.strangers`, the parameter lists fetched to name a model that differs in :mod:`.models`.

Phases (:class:`~epochal.coordinator.rules.actions.RunPhase`), in order: rendezvous -> store ->
ready -> running -> running (the next epoch), or finishing -> ended. The phase ready collects every
rank's
``epoch_ready`` only before the first epoch of a run (or of a resume); after that each loss report
carries its rank's batch counts for the next epoch and each decision that does not stop carries the
next epoch's Go, so one exchange lies between two trainings. An abort from any phase sends Abort to
every worker and ends the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules import runstate
from epochal.coordinator.rules.actions import Action, Broadcast, Log, RunPhase, Send
from epochal.coordinator.rules.batches import BatchCounts, EpochPlan
from epochal.coordinator.rules.epochs import Epochs
from epochal.coordinator.rules.finishing import Finishing
from epochal.coordinator.rules.joining import NOT_MEMBER, Joining
from epochal.coordinator.rules.machinestate import MachineState
from epochal.coordinator.rules.models import ModelChecks, ModelRecord
from epochal.coordinator.rules.regrouping import Regrouping
from epochal.coordinator.rules.takeback import TakingBack
from epochal.protocol import (
    Awaiting,
    Broken,
    Checkpointed,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Heartbeat,
    Hello,
    Message,
    ModelPage,
    Reject,
    SnapshotScope,
    Status,
    StoreReady,
    Welcome,
)
from epochal.protocol.messages import TYPE_NAMES
from epochal.text import REASON_CHARS, printable

if TYPE_CHECKING:
    from epochal.coordinator.rules.loop import LoopState
    from epochal.coordinator.rules.membership import Membership
    from epochal.coordinator.rules.rendezvous import Member, Rendezvous
    from epochal.coordinator.rules.strangers import Gate
    from epochal.coordinator.rules.watchdog import Watchdog

TAKING_BACK = (
    "the restarted coordinator is taking the run's running workers back, and a new worker has "
    "no place in it: start it once the run is over, or stop every worker to resume the run from "
    "its last checkpoint"
)
"""Why a worker in no run is refused while the workers of the run come back."""

UNANSWERED = frozenset(TYPE_NAMES[cls] for cls in (Heartbeat, Status))
"""Messages of a peer outside the run that get no answer (a worker heartbeats while it joins)."""


class RunMachine:
    """One run's control-plane state and rules; see the module docstring."""

    def __init__(
        self,
        config: CoordinatorConfig,
        state: runstate.RunState,
        *,
        run_id: str,
        now: float,
        model_record: ModelRecord | None = None,
        rendezvous_note: Callable[[], str] = lambda: "",
        attempt_id: str | None = None,
    ) -> None:
        self._state = facts = MachineState.start(
            config,
            state,
            run_id=run_id,
            attempt_id=attempt_id or run_id,
            now=now,
            model_record=model_record,
            rendezvous_note=rendezvous_note,
        )
        # each part gets the facts and, by reference, the parts it hands work on to
        self._regrouping = Regrouping(facts)
        self._finishing = Finishing(facts, self._regrouping)
        self._epochs = Epochs(facts, self._regrouping, self._finishing)
        self._takeback = TakingBack(facts, self._epochs, self._finishing)
        self._joining = Joining(facts, self._takeback.carry_welcome)

    # ------------------------------------------------------------------ what the machine knows

    @property
    def config(self) -> CoordinatorConfig:
        return self._state.config

    @property
    def run_id(self) -> str:
        return self._state.run_id

    @property
    def phase(self) -> RunPhase:
        return self._state.phase

    @property
    def epoch(self) -> int:
        """The epoch under way (or the next to start)."""
        return self._state.epoch

    @property
    def generation(self) -> int:
        """The world's generation: one more with each change (:mod:`.regrouping`)."""
        return self._state.generation

    @property
    def members(self) -> list[Member]:
        """By rank, once the ranks are assigned."""
        return self._state.members

    @property
    def over(self) -> bool:
        """Whether an outcome (Finished or Aborted) has been returned."""
        return self._state.over

    @property
    def refused(self) -> int:
        """Hellos refused by the rendezvous (wrong job or token, surplus, duplicate)."""
        return self._state.refused

    @property
    def plan(self) -> EpochPlan | None:
        """The batches every rank runs this epoch, as its Go said (None before the first Go)."""
        return self._state.plan

    @property
    def epoch_started(self) -> float:
        """When the epoch under way began, on the service's clock."""
        return self._state.epoch_started

    @property
    def round_seconds(self) -> float | None:
        """The last epoch's control round: from its first loss report to its decision."""
        return self._state.round_seconds

    @property
    def world_changes(self) -> list[dict[str, Any]]:
        """Each change of the world so far, as the result lists them."""
        return self._state.world_changes

    @property
    def models(self) -> ModelChecks:
        return self._state.models

    @property
    def rendezvous(self) -> Rendezvous:
        return self._state.rendezvous

    @property
    def gate(self) -> Gate:
        return self._state.gate

    @property
    def watchdog(self) -> Watchdog:
        return self._state.watchdog

    @property
    def membership(self) -> Membership:
        return self._state.membership

    @property
    def scope(self) -> SnapshotScope:
        """What the members' copies of an epoch's start hold together, as their readies said."""
        return self._state.scope

    @property
    def elastic(self) -> bool:
        """Whether a lost rank's peers carry on (while at least ``--min-workers`` remain)."""
        return self._regrouping.elastic

    @property
    def taking_back(self) -> bool:
        """Whether running workers are being taken back (the first came, not yet the last)."""
        return self._takeback.taking_back

    @property
    def _loop(self) -> LoopState:
        """The epoch loop's state (the run state's own), as the status feed reads it."""
        return self._state.loop

    @property
    def _gathering(self) -> int | None:
        """The epoch whose start the members gather onto rank 0 for newcomers, if any."""
        return self._state.gathering

    def _welcome_for(self, peer: bytes) -> Welcome:
        """The welcome ``peer`` gets to the world of now (once rank 0's store is open)."""
        return self._joining.welcome_for(peer)

    # ------------------------------------------------------------------ entry points

    def reads(self, now: float, peer: bytes) -> bool:
        """Whether a frame from ``peer`` is worth decoding: a member's and a parameter page asked
        for always are, a stranger's only within its own and the strangers' budget
        (:class:`~.strangers.Gate`)."""
        return self.models.asks(peer) or self.gate.reads(now, peer)

    def understands(self, peer: bytes, message: Message) -> bool:
        """Whether ``peer`` may be sent ``message``: a type every peer of the major version
        knows, or an optional one its hello said it understands."""
        if not message.optional:
            return True
        member = self.rendezvous.members.get(peer)
        return member is not None and TYPE_NAMES[type(message)] in member.hello.understands

    def knows(self, peer: bytes) -> bool:
        """Whether every frame of ``peer`` is decoded: a member's, or a peer's asked for its
        parameter list. Of a stranger only a hello is (:meth:`on_stranger` answers the rest)."""
        return peer in self.gate.sessions or self.models.asks(peer)

    def on_stranger(self, peer: bytes, kind: str) -> list[Action]:
        """The answer to a frame of type ``kind`` (not a hello) from a stranger, read no further:
        nothing for a heartbeat, else that the sender is not a member (a worker hearing it while
        in a run knows the coordinator restarted)."""
        if self.over or kind in UNANSWERED:
            return []
        return [Send(peer, Reject(reason=NOT_MEMBER, code="not_member"))]

    def on_unreadable(
        self, now: float, peer: bytes, problem: str, *, version: bool, user_id: str = ""
    ) -> list[Action]:
        """A frame from ``peer`` that does not decode: another protocol ``version``, or junk."""
        self.gate.dropped_frames += 1
        if version:
            return self.gate.reject(peer, problem, "version")
        rank = self._state.ranks.get(peer)
        if rank is not None and self.gate.sessions.same_sender(peer, user_id):
            return self.abort(
                f"rank {rank} sent a malformed message: {printable(problem, REASON_CHARS)}"
            )
        return self.gate.reject(peer, f"malformed message: {problem}", "malformed")

    def on_message(
        self, now: float, peer: bytes, message: Message, *, session: str = "", user_id: str = ""
    ) -> list[Action]:
        """A decoded ``message`` from ``peer`` with its ``session`` secret and ZAP ``user_id``."""
        state = self._state
        if state.over:
            return []
        screened = self.gate.screen(
            now, peer, message, session, user_id, self.rendezvous.members.get
        )
        if screened is not None:
            return screened
        rank = state.ranks.get(peer)
        if rank is not None or self.watchdog.knows(peer):
            self.watchdog.heard(peer, now)
        if rank is not None:
            self.membership.heard(rank, now)  # alive: a pending loss need not wait for it
        actions = self._handle(now, peer, message, user_id)
        if rank is not None and state.phase in (RunPhase.READY, RunPhase.RUNNING):
            answered = state.ready if state.phase is RunPhase.READY else state.reports
            self.watchdog.after_message(rank, peer, state.phase, state.epoch, answered)
        return actions

    def on_tick(self, now: float) -> list[Action]:
        """The clock moved to ``now``: heartbeats when due, then every timeout."""
        state = self._state
        if state.over:
            return []
        actions: list[Action] = []
        if now >= state.next_heartbeat:
            state.next_heartbeat = now + state.config.heartbeat_interval
            actions.append(Broadcast(state.recipients(), Heartbeat()))
        return actions + self._check_clock(now)

    def lost_time(self, now: float, lost: float) -> list[Action]:
        """The service itself was not running for ``lost`` seconds up to ``now``: blame nobody."""
        line = self.watchdog.forgive(now, lost)
        return [] if line is None else [Log(line)]

    def report_failure(self, now: float, what: str, *, cause: bool = False) -> None:
        """A worker failed; abort after a short settle window that lets its cause come in.

        ``cause`` marks a fact such as a worker process exiting, which goes first in the reason:
        when a rank dies, the others' collectives fail a moment later, and their errors are
        consequences.
        """
        self.watchdog.report_failure(now, what, cause=cause)

    def abort(self, reason: str, *, force: bool = False, needs_fix: bool = False) -> list[Action]:
        """End the run: Abort to every worker, the reason recorded. ``force``: also after an
        outcome, when its record could not be written. ``needs_fix``: a configuration or data
        error, which a resume would repeat (:attr:`RunAborted.needs_fix`)."""
        return self._state.abort(reason, force=force, needs_fix=needs_fix)

    def unrecorded(self, problem: str) -> list[Action]:
        """The run directory cannot be written: stop, since progress that is not recorded
        cannot be resumed (and a decision is never sent before its record is durable)."""
        return self.abort(
            f"{problem}; the run stops because it cannot record its progress", force=True
        )

    def lose(self, now: float, rank: int, why: str, *, hold: float = 0.0) -> bool:
        """``rank`` is lost, ``why``; True when the run goes on without it (elastic), False when
        the caller must treat it as a failure of the run (:meth:`.Regrouping.lose`)."""
        return self._regrouping.lose(now, rank, why, hold=hold)

    def process_exited(self, now: float, pid: int, what: str) -> bool:
        """A worker process of this machine (``pid``) exited, ``what``; True when a rank was lost
        and the run goes on without it."""
        return self._regrouping.process_exited(now, pid, what)

    def connection_closed(self, now: float, peer: bytes) -> None:
        """A member's connection closed: in an elastic run, its rank is lost."""
        self._regrouping.connection_closed(now, peer)

    # ------------------------------------------------------------------ receiving

    def _on_hello(self, now: float, peer: bytes, hello: Hello, user_id: str) -> list[Action]:
        """A hello: a running worker taken back, a newcomer refused while they come back, or a
        hello for the rendezvous (which, begun, drops the journal's way back for a resume)."""
        takeback = self._takeback
        if takeback.takes_back(hello):
            return takeback.take_back(now, peer, hello, user_id)
        if takeback.taking_back:
            return self.gate.hello_refused(now, peer, hello, user_id) or self.gate.reject(
                peer, TAKING_BACK, "refused"
            )
        actions = self._joining.on_hello(now, peer, hello, user_id)
        if self.rendezvous.members:  # a rendezvous began: the run resumes its checkpoint
            actions = takeback.forget_carry() + actions
        return actions

    def _handle(self, now: float, peer: bytes, message: Message, user_id: str) -> list[Action]:
        state = self._state
        if isinstance(message, Hello):
            return self._on_hello(now, peer, message, user_id)
        if isinstance(message, ModelPage):
            return self._joining.on_page(now, peer, message, user_id)
        rank = state.ranks.get(peer)
        if rank is None:
            return self._joining.from_outside(peer, message)
        match message:
            case Heartbeat():
                return []
            case Status():
                self.watchdog.note_status(rank, message, now)
                return []
        if self._takeback.taking_back:
            return self._takeback.from_taken(now, peer, rank, message)
        match message:
            case StoreReady() if (
                state.phase is RunPhase.STORE
                and rank == 0
                and message.generation == self.generation
            ):
                state.store = message
                return [] if self.models.busy else self._joining.welcome_all(now)
            case EpochReady() | EpochReport() | StoreReady() if (
                message.generation != self.generation
            ):
                return []  # of an older world: its epoch is being redone
            case EpochReady() if state.phase is RunPhase.READY and message.epoch == state.epoch:
                self.watchdog.note_waiting(rank, message.epoch, Awaiting.GO, now)
                state.ready[rank] = BatchCounts.of(message)
                state.copies[peer] = message
                if len(state.ready) == len(state.members):
                    return self._epochs.start_epoch(now)
                return []
            case EpochReport() if state.phase is RunPhase.RUNNING and message.epoch == state.epoch:
                self._epochs.note_report(now, peer, rank, message)
                if len(state.reports) == len(state.members):
                    return self._epochs.decide(now)
                return []
            case Checkpointed() if rank == 0 and message.epoch <= state.epoch:
                return self._finishing.on_checkpointed(now, message.epoch)
            case Done() if state.phase is RunPhase.READY and rank not in state.ready:
                # before any epoch_ready: the script keeps its own loop and used join() for the
                # rendezvous and the process group only; its session closed cleanly
                return self._finishing.closed_early(now, rank)
            case Done() if state.phase is RunPhase.FINISHING:
                return self._finishing.done_by(rank)
            case Failed():
                reason = printable(message.reason, REASON_CHARS)
                if self.lose(now, rank, f"failed: {reason}"):
                    return []
                line = f"rank {rank} ({state.members[rank].describe()}) failed: {reason}"
                self.report_failure(now, self.watchdog.after_lost_time(now, line))
                return []
            case Broken():
                return self._regrouping.on_broken(now, rank, message)
            case _:
                return self.abort(
                    f"rank {rank} sent {type(message).__name__} while the coordinator was in "
                    f"phase {state.phase} of epoch {state.epoch}: the worker and coordinator "
                    "are out of step (a bug, or mixed epochal versions)"
                )

    # ------------------------------------------------------------------ the clock

    def _check_clock(self, now: float) -> list[Action]:
        """What the clock finds between messages: a loss settled, a standby newcomer gone
        silent, a failure due, a model check overdue, then the phase's own bound."""
        state, dog = self._state, self.watchdog
        losses = self._regrouping.check_losses(now)
        if losses is not None:
            return losses
        quiet = dog.first_silent(now, self.membership.standby)
        if quiet is not None:  # a standby newcomer that went silent is forgotten
            peer = quiet[0]
            member = self.membership.leave(peer)
            assert member is not None
            self.rendezvous.leave(peer)
            self.gate.sessions.forget(peer)
            dog.drop(peer)
            return [Log(f"{member.describe()} went silent while waiting to join; forgotten")]
        if self._regrouping.elastic:
            self._regrouping.lose_silent(now)
            if self.membership.losing:
                return []
        failed = dog.failure_due(now)
        if failed is not None:
            return self.abort(failed)
        expired = self.models.expired(now)
        if expired is not None:
            return self._joining.checked(now, expired)
        if state.store is not None and state.phase is RunPhase.STORE:
            return []  # the store is open; the welcome waits for rank 0's list, a bounded while
        return self._check_phase(now, now - dog.phase_started)

    def _check_phase(self, now: float, waited: float) -> list[Action]:
        """The bound of the phase under way, ``waited`` seconds into it."""
        state = self._state
        if self._takeback.taking_back:
            return self._takeback.check_taking_back(now, waited)
        if state.carry is not None and not self.rendezvous.members:
            return self._takeback.check_first_back(waited)
        if state.phase is RunPhase.RENDEZVOUS:
            return self._joining.check_rendezvous(now, waited)
        if state.phase is RunPhase.FINISHING:
            return self._finishing.check_finishing(now, waited)
        answered = state.ready if state.phase is RunPhase.READY else state.reports
        lines, reason = self.watchdog.check(
            now,
            phase=state.phase,
            epoch=state.epoch,
            answered=answered,
            members=state.members,
            ranks=state.ranks,
            welcomed=state.store is not None,
        )
        actions: list[Action] = [Log(line) for line in lines]
        if reason is not None:
            return actions + self.abort(reason)
        return actions
