"""How workers come into a run: hellos, the model check, rank 0's store and the welcome.

:class:`Joining` is the part of :class:`~epochal.coordinator.machine.RunMachine` (its base class)
that runs from the first hello to the welcome every rank gets: it offers each hello to the
:class:`~.rendezvous.Rendezvous` and answers it (joined, refused, or an abort for a model that
differs, named through :mod:`.models`), drops members that go silent or a rendezvous that times
out, then has rank 0 open the data-plane store and welcomes every rank. The epochs themselves are
the machine's. Pure like the machine: every method takes ``now`` and returns actions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from epochal.coordinator import runstate
from epochal.coordinator.actions import Action, Log, RunPhase, Send
from epochal.coordinator.batches import BatchCounts
from epochal.coordinator.carry import Carry
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.membership import Membership, NewWorld
from epochal.coordinator.models import Checked, Differ, ModelChecks, Outcome
from epochal.coordinator.rendezvous import (
    Admitted,
    Differs,
    Fatal,
    JoinLog,
    Member,
    Refused,
    Rendezvous,
    models_differ,
    placement_lines,
)
from epochal.coordinator.strangers import Gate
from epochal.coordinator.watchdog import Watchdog
from epochal.protocol import (
    Abort,
    Failed,
    Heartbeat,
    Hello,
    Joined,
    Message,
    ModelPage,
    OpenStore,
    Reject,
    Restore,
    Status,
    StoreReady,
    Welcome,
    clip,
    understood,
)
from epochal.text import REASON_CHARS, printable

if TYPE_CHECKING:
    from pathlib import Path

NOT_MEMBER = "not a member of this run: send hello first"
"""What a peer outside the run hears when it sends anything but a hello."""


class Joining:
    """The rendezvous side of a run's machine; see the module docstring. The machine sets every
    attribute below in its ``__init__``."""

    config: CoordinatorConfig
    run_id: str
    phase: RunPhase
    models: ModelChecks
    rendezvous: Rendezvous
    gate: Gate
    watchdog: Watchdog
    members: list[Member]
    refused: int
    _state: runstate.RunState
    _joins: JoinLog
    _ranks: dict[bytes, int]
    _backend: str
    _store: StoreReady | None
    _checkpoint_dir: Path | None
    _rendezvous_note: Callable[[], str]
    _ready: dict[int, BatchCounts]
    membership: Membership
    generation: int
    epoch: int
    _change: NewWorld | None
    _carried: Carry | None

    def carry_welcome(self, rank: int, session: str, member: Member) -> Welcome:
        raise NotImplementedError  # the taking-back side's

    def abort(self, reason: str, *, force: bool = False, needs_fix: bool = False) -> list[Action]:
        raise NotImplementedError  # the machine's

    # ------------------------------------------------------------------ hellos

    def _from_outside(self, peer: bytes, message: Message) -> list[Action]:
        """A message from a peer without a rank: a member still in rendezvous, or a stranger."""
        if isinstance(message, Heartbeat | Status):
            return []
        joined = self.rendezvous.members.get(peer)
        if joined is not None and isinstance(message, Failed):
            self.rendezvous.leave(peer)
            self.membership.leave(peer)  # a standby newcomer, if it was one
            self.gate.sessions.forget(peer)
            self.watchdog.drop(peer)
            reason = printable(message.reason, REASON_CHARS)
            return [Log(f"{joined.describe()} failed before the run started: {reason}")]
        return [Send(peer, Reject(reason=NOT_MEMBER, code="not_member"))]

    def _on_hello(self, now: float, peer: bytes, hello: Hello, user_id: str) -> list[Action]:
        refused = self.gate.hello_refused(now, peer, hello, user_id)
        if refused is not None:
            return refused
        verdict = self.rendezvous.offer(peer, hello)
        if self.phase is not RunPhase.RENDEZVOUS and isinstance(verdict, Fatal | Differs):
            # a newcomer to a run under way: refused, and the run goes on
            self.rendezvous.leave(peer)
            why = (
                verdict.reason
                if isinstance(verdict, Fatal)
                else "its model differs from the run's (another digest of its parameters): start "
                "it with the run's model"
            )
            verdict = Refused(why)
        match verdict:
            case Refused(reason=reason):
                self.refused += 1
                line = (
                    f"refused worker {printable(hello.worker_id)} from {printable(hello.host)}: "
                    f"{reason}"
                )
                return self.gate.refusal(now, line) + self.gate.reject(peer, reason, "refused")
            case Fatal(reason=reason):  # the run's configuration: a resume would meet it again
                return [
                    Send(peer, Abort(reason=clip(reason))),
                    *self.abort(reason, needs_fix=True),
                ]
            case Differs(reference=ref):
                other = Member(peer, hello)
                asks, outcome = self.models.differ(
                    now,
                    (ref.peer, ref.hello.fingerprint, ref.describe()),
                    (peer, hello.fingerprint, other.describe()),
                    user_id,
                )
                return asks + self._checked(now, outcome)
            case Admitted(again=False) if self.phase is not RunPhase.RENDEZVOUS:
                if self.membership.has_room() and not self.membership.dropped(
                    hello.worker_id, hello.host, hello.pid
                ):
                    return self._standby(now, peer, hello, user_id)
                self.rendezvous.leave(peer)
                return self.gate.reject(peer, self._no_newcomer(hello), "refused")
            case Admitted(again=again):
                self.watchdog.heard(peer, now)
                session = self.gate.sessions.issue(peer, user_id)
                joined = len(self.rendezvous.members)
                if again and peer in self._ranks:
                    if self._store is None and self._carried is not None:  # taken back
                        rank = self._ranks[peer]
                        welcome = self.carry_welcome(rank, session, self.members[rank])
                        return [Send(peer, welcome), *self._rehello(now, peer)]
                    if self._store is None or self.models.busy:
                        return []
                    return [Send(peer, self._welcome_for(peer)), *self._rehello(now, peer)]
                world = self.config.world_size
                actions: list[Action] = [
                    Send(
                        peer,
                        Joined(
                            joined=joined,
                            world_size=world,
                            session=session,
                            liveness=self.config.liveness,
                        ),
                    )
                ]
                if again:
                    return actions
                actions += [Log(line) for line in self._joins.joined(now, hello, joined)]
                if self.rendezvous.complete:
                    actions += self._complete(now)
                return actions
        raise AssertionError(f"unknown verdict {verdict!r}")

    def _standby(self, now: float, peer: bytes, hello: Hello, user_id: str) -> list[Action]:
        """A newcomer to an elastic run with room: it waits as a standby, heartbeating, and
        joins the world at the next epoch boundary (:meth:`Membership.at_boundary`)."""
        member = Member(peer, hello)
        self.membership.wait(member)
        self.watchdog.heard(peer, now)
        session = self.gate.sessions.issue(peer, user_id)
        joined = Joined(
            joined=len(self.members),
            world_size=self.config.world_size,
            session=session,
            liveness=self.config.liveness,
        )
        size = len(self.members) + len(self.membership.standby)
        return [
            Send(peer, joined),
            Log(
                f"{member.describe()} is waiting to join the run: it joins at the next epoch "
                f"boundary ({size} of at most {self.config.world_size} workers then)"
            ),
        ]

    def _no_newcomer(self, hello: Hello) -> str:
        """Why a new worker may not join a run under way."""
        why = self.membership.dropped(hello.worker_id, hello.host, hello.pid)
        if why is not None:
            return self.membership.why_dropped(printable(why, REASON_CHARS))
        if self.config.elastic:
            return (
                f"the run has as many workers and newcomers waiting as --world-size "
                f"{self.config.world_size} admits: a newcomer joins once a worker is lost"
            )
        return (
            "the run is under way with its workers and admits newcomers only when it is elastic "
            "(--min-workers below --world-size): start the worker with the next run"
        )

    def _rehello(self, now: float, peer: bytes) -> list[Action]:
        """Log (once per heartbeat timeout) a rank saying hello again in the middle of the run."""
        if self._joins.crossed(now, self.config.heartbeat_timeout):
            return []  # a retry that crossed its Joined, not a worker that lost the coordinator
        rank = self._ranks[peer]
        if not self.watchdog.rehello_due(rank, now):
            return []
        return [
            Log(
                f"rank {rank} ({self.members[rank].describe()}) said hello again: it heard "
                "nothing from this coordinator for its own heartbeat timeout (was the "
                "coordinator not running?) and re-attached; it carries on where it was"
            )
        ]

    # ------------------------------------------------------------------ the model

    def _complete(self, now: float) -> list[Action]:
        """Every worker is in: open the store and meanwhile check (or record) the run directory's
        model, fetching rank 0's list when the record needs it; the welcome waits for both."""
        if self.models.busy:
            return []  # a model difference is being named: the run ends with it
        actions = self._open_store(now)
        rank0 = self.members[0]
        asks, outcome = self.models.complete(
            now, (rank0.peer, rank0.hello.fingerprint, rank0.describe())
        )
        return actions + asks + self._checked(now, outcome)

    def _on_page(self, now: float, peer: bytes, page: ModelPage, user_id: str) -> list[Action]:
        taken, asks, outcome = self.models.on_page(peer, page, user_id)
        if not taken:
            self.gate.ignored_frames += 1  # a page nobody asked for
        return asks + self._checked(now, outcome)

    def _checked(self, now: float, outcome: Outcome | None) -> list[Action]:
        """What a model check's ``outcome`` makes the run do."""
        match outcome:
            case Differ(difference=difference, peer=peer):
                reason = models_differ(difference)
                return [
                    Send(peer, Abort(reason=clip(reason))),
                    *self.abort(reason, needs_fix=True),
                ]
            case Checked(problem=str(problem)):
                return self.abort(problem)
            case Checked(note=note):
                actions: list[Action] = [] if note is None else [Log(note)]
                if self._store is not None:  # rank 0's store was ready first: welcome now
                    actions += self._welcome_all(now)
                return actions
        return []

    # ------------------------------------------------------------------ the store and the welcome

    def _set_phase(self, phase: RunPhase, now: float) -> None:
        self.phase = phase
        self.watchdog.phase_began(now)

    def _open_store(self, now: float) -> list[Action]:
        self._ranks, self._backend = self.rendezvous.assign()
        by_rank: list[Member | None] = [None] * self.config.world_size
        for peer, rank in self._ranks.items():
            by_rank[rank] = self.rendezvous.members[peer]
        self.members = [m for m in by_rank if m is not None]
        self.membership.form(tuple(self.members))
        self._set_phase(RunPhase.STORE, now)
        return [Send(self.members[0].peer, OpenStore(run_id=self.run_id))]

    def _welcome_for(self, peer: bytes) -> Welcome:
        assert self._store is not None
        first = self.generation == 0  # the run's first world: from its start or its checkpoint
        return Welcome(
            rank=self._ranks[peer],
            world_size=len(self.members),
            run_id=self.run_id,
            backend=self._backend,
            store_host=self._store.host,
            store_port=self._store.port,
            start_epoch=self._state.start_epoch if first else self.epoch,
            epochs=self.config.epochs,
            resume_epoch=self._state.resume_epoch if first else self._restored_checkpoint(),
            checkpoint_dir=str(self._checkpoint_dir or ""),
            session=self.gate.sessions.issue(peer, ""),
            liveness=self.config.liveness,
            store_key=self._store.key,
            replica_check=self.config.replica_check,
            generation=self.generation,
            restore=self._restore_for(peer),
            elastic=self.config.elastic,
            understands=understood(),
        )

    def _restored_checkpoint(self) -> int | None:
        """The checkpoint a new world loads (``welcome.resume_epoch``), if it restores one."""
        change = self._change
        return None if change is None else change.checkpoint

    def _restore_for(self, peer: bytes) -> str:
        """How ``peer`` takes the state of the epoch it starts (``welcome.restore``): nothing to
        restore in the run's first world; in a new one as the change decided, a newcomer from
        its peers unless every member loads the checkpoint."""
        change = self._change
        if change is None:
            return Restore.NONE.value if self.generation == 0 else Restore.MEMORY.value
        if change.restore is not Restore.CHECKPOINT and any(
            member.peer == peer for member in change.joined
        ):
            return Restore.PEERS.value
        return change.restore.value

    def _welcome_all(self, now: float) -> list[Action]:
        assert self._store is not None
        actions: list[Action] = [Send(m.peer, self._welcome_for(m.peer)) for m in self.members]
        actions.append(
            Log(
                f"run {self.run_id}: {len(self.members)} workers, backend {self._backend}, "
                f"data-plane store at {printable(self._store.host)}:{self._store.port}"
            )
        )
        actions += [Log(line) for line in placement_lines(self.members)]
        self._set_phase(RunPhase.READY, now)
        return actions

    def _check_rendezvous(self, now: float, waited: float) -> list[Action]:
        actions: list[Action] = []
        for peer in self.watchdog.silent(now):
            member = self.rendezvous.members.get(peer)
            if member is not None:
                actions.append(Log(f"{member.describe()} went silent during rendezvous; dropped"))
                self.rendezvous.leave(peer)
                self.gate.sessions.forget(peer)
            self.watchdog.drop(peer)
        if waited > self.config.rendezvous_timeout and not self.models.busy:
            cfg = self.config
            joined = len(self.rendezvous.members)
            return actions + self.abort(
                f"only {joined} of {cfg.world_size} workers joined within "
                f"{cfg.rendezvous_timeout:g} s: start the missing workers, or lower "
                f"--world-size{self._rendezvous_note()}"
            )
        return actions
