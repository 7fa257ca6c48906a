"""The run's phase machine: every decision all ranks must share, as a pure function of the clock.

:class:`RunMachine` takes ``now`` and what arrived (:meth:`~RunMachine.on_message`), or just ``now``
(:meth:`~RunMachine.on_tick`), and returns the :mod:`actions <epochal.coordinator.actions>` that
follow: messages to send, records to write, lines to log, the end of the run. It opens no socket,
reads no clock and touches no file (the run directory's model record is handed in), so a whole run
is driven by a test with a clock it sets (``tests/coordinator/test_machine.py``). The clock rules
themselves are in :mod:`.watchdog` (what each tick makes of them in :mod:`.finishing`, with how
the run ends), the budget of peers outside the run in :mod:`.strangers`, the
parameter lists fetched to name a model that differs in :mod:`.models`.

Phases (:class:`~epochal.coordinator.actions.RunPhase`), in order: rendezvous -> store -> ready
-> running -> running (the next epoch), or finishing -> ended. The phase ready collects every rank's
``epoch_ready`` only before the first epoch of a run (or of a resume); after that each loss report
carries its rank's batch counts for the next epoch and each decision that does not stop carries the
next epoch's Go, so one exchange lies between two trainings. An abort from any phase sends Abort to
every worker and ends the run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from epochal.coordinator import ending, runstate
from epochal.coordinator.actions import (
    Aborted,
    Action,
    Broadcast,
    Journal,
    Log,
    RunPhase,
    Send,
)
from epochal.coordinator.batches import (
    BatchCounts,
    EpochPlan,
    PolicyViolation,
    format_ranks,
    plan_epoch,
)
from epochal.coordinator.carry import Carry, sent_record
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.finishing import Finishing
from epochal.coordinator.joining import NOT_MEMBER
from epochal.coordinator.loop import LoopState
from epochal.coordinator.membership import Membership, NewWorld
from epochal.coordinator.models import ModelChecks, ModelRecord
from epochal.coordinator.outcome import checkpoint_after, format_epoch_line
from epochal.coordinator.rendezvous import (
    JoinLog,
    Member,
    Rendezvous,
)
from epochal.coordinator.replicas import replicas_differ
from epochal.coordinator.strangers import Gate
from epochal.coordinator.sums import LossSums, aggregate_metrics, metric_values
from epochal.coordinator.sums import aggregate as aggregate_losses
from epochal.coordinator.watchdog import Watchdog
from epochal.protocol import (
    Abort,
    Awaiting,
    Broken,
    Checkpointed,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Go,
    Heartbeat,
    Hello,
    Message,
    ModelPage,
    Reject,
    Status,
    StoreReady,
    clip,
)
from epochal.protocol.messages import TYPE_NAMES
from epochal.text import REASON_CHARS, printable

TAKING_BACK = (
    "the restarted coordinator is taking the run's running workers back, and a new worker has "
    "no place in it: start it once the run is over, or stop every worker to resume the run from "
    "its last checkpoint"
)
"""Why a worker in no run is refused while the workers of the run come back."""

UNANSWERED = frozenset(TYPE_NAMES[cls] for cls in (Heartbeat, Status))
"""Messages of a peer outside the run that get no answer (a worker heartbeats while it joins)."""


class RunMachine(Finishing):
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
    ) -> None:
        self.config = config
        self.run_id = run_id
        self.phase = RunPhase.RENDEZVOUS
        self._state = state
        self._loop = state.loop
        self.models = ModelChecks(model_record)
        # between workers, and against the run directory: parameter lists fetched page by page
        self._rendezvous_note = rendezvous_note
        # why a rendezvous may fall short besides missing workers (refused CURVE handshakes)
        self.rendezvous = Rendezvous(config)
        self._joins = JoinLog(config.world_size)
        self.gate = Gate()
        self.watchdog = Watchdog(config, now)
        self._ranks: dict[bytes, int] = {}
        self.members: list[Member] = []
        # by rank, once the ranks are assigned
        self._backend = "gloo"
        self._store: StoreReady | None = None
        self.epoch = state.start_epoch
        self._ready: dict[int, BatchCounts] = {}
        # phase ready: the batch counts of every rank's epoch_ready so far
        self._reports: dict[int, LossSums] = {}
        self._next: dict[int, BatchCounts] = {}
        # phase running: the batch counts for the next epoch that the loss reports carried
        self._rates: dict[int, float | None] = {}
        # phase running: the learning rate each rank's optimizer held, where it said it
        self._checksums: dict[int, int | None] = {}
        # phase running: each rank's checksum of its weights after the epoch, where it sent one
        self._done: set[int] = set()
        self._finish_decided = True  # the Finish followed the last epoch's decision
        self._plan: EpochPlan | None = None
        self._validates = False
        self._checkpoint_dir = config.checkpoint_path
        self._committed = [r["epoch"] for r in state.records if r["kind"] == "checkpoint"]
        self._epoch_started = now
        self._next_heartbeat = now
        self.over = False
        # an outcome (Finished or Aborted) has been returned
        self.refused = 0
        # hellos refused by the rendezvous (wrong job or token, surplus, duplicate), for observers
        self._round_started = now
        self.round_seconds: float | None = None
        # the last epoch's control round: from its first loss report to its decision
        self.membership = Membership(config.least_workers, config.world_size)
        self.generation = 0
        # the world's: one more with each change (regrouping.py)
        self.world_changes: list[dict[str, Any]] = []
        self._change: NewWorld | None = None
        # the change whose world is forming
        self._copies: dict[bytes, EpochReady] = {}
        # each member's last ready: what its copy of an epoch's start holds, and whether it
        # gathers its part of the state when a decision asks (elastic)
        self._gathering: int | None = None
        # the epoch whose start the members gather onto rank 0 (Decision.gather): the world
        # grows once their readies of it are in
        self._loops_at: dict[int, LoopState] = {}
        # elastic: the loop state as each checkpoint holds it, for a world that restores one
        if config.elastic and state.resume_epoch is not None:
            self._loops_at[state.resume_epoch] = copy.deepcopy(state.loop)
        self._carry = state.carry
        # where the journal left the run, for running workers that come back (takeback.py)
        self._taken: dict[int, Member] = {}
        # by rank, the workers taken back so far (welcomed)
        self._back: set[int] = set()
        # the ranks taken back that sent again what they wait an answer to
        self._carried: Carry | None = None
        # where the run was taken back from, once it was

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
        rank = self._ranks.get(peer)
        if rank is not None and self.gate.sessions.same_sender(peer, user_id):
            return self.abort(
                f"rank {rank} sent a malformed message: {printable(problem, REASON_CHARS)}"
            )
        return self.gate.reject(peer, f"malformed message: {problem}", "malformed")

    def on_message(
        self, now: float, peer: bytes, message: Message, *, session: str = "", user_id: str = ""
    ) -> list[Action]:
        """A decoded ``message`` from ``peer`` with its ``session`` secret and ZAP ``user_id``."""
        if self.over:
            return []
        screened = self.gate.screen(
            now, peer, message, session, user_id, self.rendezvous.members.get
        )
        if screened is not None:
            return screened
        rank = self._ranks.get(peer)
        if rank is not None or self.watchdog.knows(peer):
            self.watchdog.heard(peer, now)
        if rank is not None:
            self.membership.heard(rank, now)  # alive: a pending loss need not wait for it
        actions = self._handle(now, peer, message, user_id)
        if rank is not None and self.phase in (RunPhase.READY, RunPhase.RUNNING):
            answered = self._ready if self.phase is RunPhase.READY else self._reports
            self.watchdog.after_message(rank, peer, self.phase, self.epoch, answered)
        return actions

    def on_tick(self, now: float) -> list[Action]:
        """The clock moved to ``now``: heartbeats when due, then every timeout."""
        if self.over:
            return []
        actions: list[Action] = []
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval
            actions.append(Broadcast(self._recipients(), Heartbeat()))
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
        if self.over and not force:
            return []
        self.over = True
        return [
            Log(f"run aborted: {reason}"),
            Broadcast(self._recipients(), Abort(reason=clip(reason))),
            Journal("result", {"status": "aborted", "run_id": self.run_id, "reason": reason}, True),
            Aborted(reason, needs_fix=needs_fix),
        ]

    def unrecorded(self, problem: str) -> list[Action]:
        """The run directory cannot be written: stop, since progress that is not recorded
        cannot be resumed (and a decision is never sent before its record is durable)."""
        return self.abort(
            f"{problem}; the run stops because it cannot record its progress", force=True
        )

    # ------------------------------------------------------------------ sending

    def _recipients(self) -> tuple[bytes, ...]:
        if self.members:
            return tuple(m.peer for m in self.members)
        return tuple(self.rendezvous.members)

    # ------------------------------------------------------------------ receiving

    def _handle(self, now: float, peer: bytes, message: Message, user_id: str) -> list[Action]:
        if isinstance(message, Hello):
            if self.takes_back(message):
                return self._take_back(now, peer, message, user_id)
            if self.taking_back:
                return self.gate.hello_refused(now, peer, message, user_id) or self.gate.reject(
                    peer, TAKING_BACK, "refused"
                )
            actions = self._on_hello(now, peer, message, user_id)
            if self.rendezvous.members:  # a rendezvous began: the run resumes its checkpoint
                actions = self._forget_carry() + actions
            return actions
        if isinstance(message, ModelPage):
            return self._on_page(now, peer, message, user_id)
        rank = self._ranks.get(peer)
        if rank is None:
            return self._from_outside(peer, message)
        match message:
            case Heartbeat():
                return []
            case Status():
                self.watchdog.note_status(rank, message, now)
                return []
        if self.taking_back:
            return self._from_taken(now, peer, rank, message)
        match message:
            case StoreReady() if (
                self.phase is RunPhase.STORE and rank == 0 and message.generation == self.generation
            ):
                self._store = message
                return [] if self.models.busy else self._welcome_all(now)
            case EpochReady() | EpochReport() | StoreReady() if (
                message.generation != self.generation
            ):
                return []  # of an older world: its epoch is being redone
            case EpochReady() if self.phase is RunPhase.READY and message.epoch == self.epoch:
                self.watchdog.note_waiting(rank, message.epoch, Awaiting.GO, now)
                self._ready[rank] = BatchCounts(message.train_batches, message.valid_batches)
                self._copies[peer] = message
                if len(self._ready) == len(self.members):
                    return self._start_epoch(now)
                return []
            case EpochReport() if self.phase is RunPhase.RUNNING and message.epoch == self.epoch:
                self._note_report(now, peer, rank, message)
                if len(self._reports) == len(self.members):
                    return self._decide(now)
                return []
            case Checkpointed() if rank == 0 and message.epoch <= self.epoch:
                return self._on_checkpointed(now, message.epoch)
            case Done() if self.phase is RunPhase.READY and rank not in self._ready:
                # before any epoch_ready: the script keeps its own loop and used join() for the
                # rendezvous and the process group only; its session closed cleanly
                return self._closed_early(now, rank)
            case Done() if self.phase is RunPhase.FINISHING:
                return self._done_by(rank)
            case Failed():
                reason = printable(message.reason, REASON_CHARS)
                if self.lose(now, rank, f"failed: {reason}"):
                    return []
                line = f"rank {rank} ({self.members[rank].describe()}) failed: {reason}"
                self.report_failure(now, self.watchdog.after_lost_time(now, line))
                return []
            case Broken():
                return self._on_broken(now, rank, message)
            case _:
                return self.abort(
                    f"rank {rank} sent {type(message).__name__} while the coordinator was in "
                    f"phase {self.phase} of epoch {self.epoch}: the worker and coordinator "
                    "are out of step (a bug, or mixed epochal versions)"
                )

    def _note_report(self, now: float, peer: bytes, rank: int, report: EpochReport) -> None:
        """Keep ``rank``'s report of the epoch under way until every rank's is in."""
        self.watchdog.note_waiting(rank, report.epoch, Awaiting.DECISION, now)
        if not self._reports:
            self._round_started = now
        self._reports[rank] = LossSums(
            report.train_loss_sum,
            report.train_count,
            report.valid_loss_sum,
            report.valid_count,
            {m.name: (m.total, m.count) for m in report.train_metrics},
            {m.name: (m.total, m.count) for m in report.valid_metrics},
        )
        self._checksums[rank] = report.checksum
        self._rates[rank] = report.lr
        if report.ready is not None:
            ready = report.ready
            self._next[rank] = BatchCounts(ready.train_batches, ready.valid_batches)
            self._copies[peer] = ready

    def _start_epoch(self, now: float) -> list[Action]:
        """Every rank's epoch_ready is in (the first epoch of a run, of a resume or of a new
        world): its Go. Of an epoch whose start the members gathered for newcomers: the world
        grows instead (unless they left meanwhile), and its readies bring the Go."""
        if self._gathering == self.epoch:
            self._gathering = None
            grown = self._grow(now, gathered=True)
            if grown is not None:
                return grown
        formed = self._world_formed(now)
        if self._loop.history and self._loop.history[-1].stop:
            self._ready.clear()  # resumed after the last decision: only the finish is left
            return formed + self._finish(now)
        try:
            go = self._go(self.epoch, self._ready)
        except PolicyViolation as exc:
            return formed + self.abort(f"epoch {self.epoch}: {exc}", needs_fix=True)
        self._ready.clear()
        self._run(now)
        record = {  # a restarted coordinator answers a rank that missed it with the same go
            "kind": "go",
            "epoch": self.epoch,
            "sent": sent_record(go),
            "validates": self._validates,
            "world_size": len(self.members),
            "generation": self.generation,
        }
        return [*formed, Journal("epoch", record), Broadcast(self._recipients(), go)]

    def _clear_round(self) -> None:
        """Forget what the ranks of a world that is gone said of the current epoch."""
        self._ready.clear()
        self._reports.clear()
        self._next.clear()
        self._checksums.clear()
        self._rates.clear()
        self._done.clear()

    def _go(self, epoch: int, counts: dict[int, BatchCounts]) -> Go:
        """Plan ``epoch`` from every rank's batch ``counts`` (or raise PolicyViolation): its Go."""
        plan = plan_epoch(counts, self.config.batch_policy)
        self._validates = plan.valid_batches > 0  # every rank has validation data
        validate_now = self._validates and self.config.validates(epoch)
        self._plan = EpochPlan(plan.train_batches, plan.valid_batches if validate_now else 0)
        return Go(
            epoch=epoch,
            train_batches=self._plan.train_batches,
            valid_batches=self._plan.valid_batches,
            lr_factor=self._loop.lr_factor,
        )

    def _run(self, now: float) -> None:
        """Epoch ``self.epoch`` starts: its Go goes out now."""
        self._set_phase(RunPhase.RUNNING, now)
        self._epoch_started = now

    def _decide(self, now: float) -> list[Action]:
        checksums, self._checksums = self._checksums, {}
        rates, self._rates = self._rates, {}
        rate = next((rates[r] for r in sorted(rates) if rates[r] is not None), None)
        if self.config.replica_check:
            differ = replicas_differ(self.epoch, checksums)
            if differ is not None:  # before the decision: nothing of this epoch is kept
                return self.abort(differ)
        try:
            train_loss, valid_loss = aggregate_losses(self._reports)
            sums = aggregate_metrics(self._reports)
            outcome = self._loop.update(
                self.epoch,
                train_loss,
                valid_loss,
                validates=self._validates,
                metrics=metric_values(sums),
                lr=rate,
            )
        except PolicyViolation as exc:
            return self.abort(f"epoch {self.epoch}: {exc}", needs_fix=True)
        self._reports.clear()
        counts, self._next = self._next, {}
        self.round_seconds = now - self._round_started
        checkpoint = checkpoint_after(self.config, outcome)
        if checkpoint and self.config.elastic:
            self._loops_at[self.epoch] = copy.deepcopy(self._loop)
        seconds = now - self._epoch_started
        plan = self._plan
        assert plan is not None
        record = outcome.record(
            validates=self._validates, checkpoint=checkpoint, plan=plan, seconds=seconds
        )
        record.update(world_size=len(self.members), generation=self.generation)
        actions: list[Action] = [Journal("epoch", record)]
        said = Log(
            format_epoch_line(outcome, self.config.epochs, seconds, monitor=self.config.monitor)
        )
        if outcome.stop:
            decision = outcome.decision(checkpoint, sums)
            record["next"] = {"sent": sent_record(decision)}
            actions += [Broadcast(self._recipients(), decision), said]
            actions += [Log(line) for line in ending.stop_lines(outcome, self._loop, self.config)]
            return actions + self._finish(now)
        following = self.epoch + 1
        if len(counts) < len(self.members):
            missing = sorted(set(range(len(self.members))) - set(counts))
            reason = (
                f"{format_ranks(missing)} reported epoch {self.epoch} without its batch counts for "
                f"epoch {following}: the worker and coordinator are out of step (a bug, or mixed "
                "epochal versions)"
            )
            return [*actions, said, *self.abort(reason)]
        gather = self._gathers_now()
        try:
            # a world that grows after gathering plans the epoch from the new world's readies
            go = None if gather else self._go(following, counts)
        except PolicyViolation as exc:  # the decision is journaled; no rank trains that epoch
            return [*actions, said, *self.abort(f"epoch {following}: {exc}", needs_fix=True)]
        decision = outcome.decision(checkpoint, sums, go, gather=gather)
        # kept whole, with the plan of the next epoch: a restarted coordinator answers a rank
        # that missed it with the same decision (the record dict is the Journal action's)
        record["next"] = {"sent": sent_record(decision), "validates": self._validates}
        actions += [Broadcast(self._recipients(), decision), said]
        self.epoch = following
        if gather:
            # every member gathers its part of the state onto rank 0 in the group it is in,
            # then says epoch_ready (nobody trains): the world grows at those readies
            self._gathering = following
            self._set_phase(RunPhase.READY, now)
            return actions
        grown = self._grow(now)
        if grown is not None:
            # newcomers are waiting: the world grows, and the epoch just started begins again in
            # it (each member restores its start, taken before its first step, if it got there)
            return actions + grown
        self._run(now)
        return actions
