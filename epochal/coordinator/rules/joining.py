"""How workers come into a run: hellos, the model check, rank 0's store and the welcome.

:class:`Joining` is the part of :class:`~epochal.coordinator.rules.machine.RunMachine` that runs
from
the first hello to the welcome every rank gets: it offers each hello to the
:class:`~.rendezvous.Rendezvous` and answers it (joined, refused, or an abort for a model that
differs, named through :mod:`.models`), drops members that go silent or a rendezvous that times
out, then has rank 0 open the data-plane store and welcomes every rank. The epochs themselves are
:mod:`.epochs`'. It reads and changes the run's facts in the :class:`~.machinestate.MachineState`
it is given. Pure like the machine: every method takes ``now`` and returns actions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from epochal.coordinator.rules.actions import Action, Log, RunPhase, Send
from epochal.coordinator.rules.models import Checked, Differ, Outcome
from epochal.coordinator.rules.rendezvous import (
    Admitted,
    Differs,
    Fatal,
    Member,
    Refused,
    models_differ,
    placement_lines,
)
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
    Welcome,
    clip,
    understood,
)
from epochal.text import REASON_CHARS, printable

if TYPE_CHECKING:
    from epochal.coordinator.rules.machinestate import MachineState

NOT_MEMBER = "not a member of this run: send hello first"
"""What a peer outside the run hears when it sends anything but a hello."""


class Joining:
    """The rendezvous part of a run's machine; see the module docstring."""

    def __init__(
        self,
        state: MachineState,
        carry_welcome: Callable[[int, str, Member], Welcome],
    ) -> None:
        self._state = state
        self._carry_welcome = carry_welcome
        # a rank taken back by a restarted coordinator that says hello again is welcomed as the
        # taking back did (takeback.py): it has no store of this coordinator's to name

    # ------------------------------------------------------------------ hellos

    def from_outside(self, peer: bytes, message: Message) -> list[Action]:
        """A message from a peer without a rank: a member still in rendezvous, or a stranger."""
        if isinstance(message, Heartbeat | Status):
            return []
        joined = self._state.rendezvous.members.get(peer)
        if joined is not None and isinstance(message, Failed):
            self._state.rendezvous.leave(peer)
            self._state.membership.leave(peer)  # a standby newcomer, if it was one
            self._state.gate.sessions.forget(peer)
            self._state.watchdog.drop(peer)
            reason = printable(message.reason, REASON_CHARS)
            return [Log(f"{joined.describe()} failed before the run started: {reason}")]
        return [Send(peer, Reject(reason=NOT_MEMBER, code="not_member"))]

    def on_hello(self, now: float, peer: bytes, hello: Hello, user_id: str) -> list[Action]:
        refused = self._state.gate.hello_refused(now, peer, hello, user_id)
        if refused is not None:
            return refused
        verdict = self._state.rendezvous.offer(peer, hello)
        if self._state.phase is not RunPhase.RENDEZVOUS and isinstance(verdict, Fatal | Differs):
            # a newcomer to a run under way: refused, and the run goes on
            self._state.rendezvous.leave(peer)
            why = (
                verdict.reason
                if isinstance(verdict, Fatal)
                else "its model differs from the run's (another digest of its parameters): start "
                "it with the run's model"
            )
            verdict = Refused(why)
        match verdict:
            case Refused(reason=reason):
                self._state.refused += 1
                line = (
                    f"refused worker {printable(hello.worker_id)} from {printable(hello.host)}: "
                    f"{reason}"
                )
                return self._state.gate.refusal(now, line) + self._state.gate.reject(
                    peer, reason, "refused"
                )
            case Fatal(reason=reason):  # the run's configuration: a resume would meet it again
                return [
                    Send(peer, Abort(reason=clip(reason))),
                    *self._state.abort(reason, needs_fix=True),
                ]
            case Differs(reference=ref):
                other = Member(peer, hello)
                asks, outcome = self._state.models.differ(
                    now,
                    (ref.peer, ref.hello.fingerprint, ref.describe()),
                    (peer, hello.fingerprint, other.describe()),
                    user_id,
                )
                return asks + self.checked(now, outcome)
            case Admitted(again=False) if self._state.phase is not RunPhase.RENDEZVOUS:
                if self._state.membership.has_room() and not self._state.membership.dropped(
                    hello.worker_id, hello.host, hello.pid
                ):
                    return self._standby(now, peer, hello, user_id)
                self._state.rendezvous.leave(peer)
                return self._state.gate.reject(peer, self._no_newcomer(hello), "refused")
            case Admitted(again=again):
                self._state.watchdog.heard(peer, now)
                session = self._state.gate.sessions.issue(peer, user_id)
                joined = len(self._state.rendezvous.members)
                if again and peer in self._state.ranks:
                    if self._state.store is None and self._state.carried is not None:  # taken back
                        rank = self._state.ranks[peer]
                        welcome = self._carry_welcome(rank, session, self._state.members[rank])
                        return [Send(peer, welcome), *self._rehello(now, peer)]
                    if self._state.store is None or self._state.models.busy:
                        return []
                    return [Send(peer, self.welcome_for(peer)), *self._rehello(now, peer)]
                world = self._state.config.world_size
                actions: list[Action] = [
                    Send(
                        peer,
                        Joined(
                            joined=joined,
                            world_size=world,
                            session=session,
                            liveness=self._state.config.liveness,
                        ),
                    )
                ]
                if again:
                    return actions
                actions += [Log(line) for line in self._state.joins.joined(now, hello, joined)]
                if self._state.rendezvous.complete:
                    actions += self._complete(now)
                return actions
        raise AssertionError(f"unknown verdict {verdict!r}")

    def _standby(self, now: float, peer: bytes, hello: Hello, user_id: str) -> list[Action]:
        """A newcomer to an elastic run with room: it waits as a standby, heartbeating, and
        joins the world at the next epoch boundary (:meth:`Membership.at_boundary`)."""
        member = Member(peer, hello)
        self._state.membership.wait(member)
        self._state.watchdog.heard(peer, now)
        session = self._state.gate.sessions.issue(peer, user_id)
        joined = Joined(
            joined=len(self._state.members),
            world_size=self._state.config.world_size,
            session=session,
            liveness=self._state.config.liveness,
        )
        size = len(self._state.members) + len(self._state.membership.standby)
        return [
            Send(peer, joined),
            Log(
                f"{member.describe()} is waiting to join the run: it joins at the next epoch "
                f"boundary ({size} of at most {self._state.config.world_size} workers then)"
            ),
        ]

    def _no_newcomer(self, hello: Hello) -> str:
        """Why a new worker may not join a run under way."""
        why = self._state.membership.dropped(hello.worker_id, hello.host, hello.pid)
        if why is not None:
            return self._state.membership.why_dropped(printable(why, REASON_CHARS))
        if self._state.config.elastic:
            return (
                f"the run has as many workers and newcomers waiting as --world-size "
                f"{self._state.config.world_size} admits: a newcomer joins once a worker is lost"
            )
        return (
            "the run is under way with its workers and admits newcomers only when it is elastic "
            "(--min-workers below --world-size): start the worker with the next run"
        )

    def _rehello(self, now: float, peer: bytes) -> list[Action]:
        """Log (once per heartbeat timeout) a rank saying hello again in the middle of the run."""
        if self._state.joins.crossed(now, self._state.config.heartbeat_timeout):
            return []  # a retry that crossed its Joined, not a worker that lost the coordinator
        rank = self._state.ranks[peer]
        if not self._state.watchdog.rehello_due(rank, now):
            return []
        return [
            Log(
                f"rank {rank} ({self._state.members[rank].describe()}) said hello again: it heard "
                "nothing from this coordinator for its own heartbeat timeout (was the "
                "coordinator not running?) and re-attached; it carries on where it was"
            )
        ]

    # ------------------------------------------------------------------ the model

    def _complete(self, now: float) -> list[Action]:
        """Every worker is in: open the store and meanwhile check (or record) the run directory's
        model, fetching rank 0's list when the record needs it; the welcome waits for both."""
        if self._state.models.busy:
            return []  # a model difference is being named: the run ends with it
        actions = self._open_store(now)
        rank0 = self._state.members[0]
        asks, outcome = self._state.models.complete(
            now, (rank0.peer, rank0.hello.fingerprint, rank0.describe())
        )
        return actions + asks + self.checked(now, outcome)

    def on_page(self, now: float, peer: bytes, page: ModelPage, user_id: str) -> list[Action]:
        taken, asks, outcome = self._state.models.on_page(peer, page, user_id)
        if not taken:
            self._state.gate.ignored_frames += 1  # a page nobody asked for
        return asks + self.checked(now, outcome)

    def checked(self, now: float, outcome: Outcome | None) -> list[Action]:
        """What a model check's ``outcome`` makes the run do."""
        match outcome:
            case Differ(difference=difference, peer=peer):
                reason = models_differ(difference)
                return [
                    Send(peer, Abort(reason=clip(reason))),
                    *self._state.abort(reason, needs_fix=True),
                ]
            case Checked(problem=str(problem)):
                return self._state.abort(problem)
            case Checked(note=note):
                actions: list[Action] = [] if note is None else [Log(note)]
                if self._state.store is not None:  # rank 0's store was ready first: welcome now
                    actions += self.welcome_all(now)
                return actions
        return []

    # ------------------------------------------------------------------ the store and the welcome

    def _open_store(self, now: float) -> list[Action]:
        self._state.ranks, self._state.backend = self._state.rendezvous.assign()
        by_rank: list[Member | None] = [None] * self._state.config.world_size
        for peer, rank in self._state.ranks.items():
            by_rank[rank] = self._state.rendezvous.members[peer]
        self._state.members = [m for m in by_rank if m is not None]
        self._state.membership.form(tuple(self._state.members))
        self._state.set_phase(RunPhase.STORE, now)
        return [Send(self._state.members[0].peer, OpenStore(run_id=self._state.attempt_id))]

    def welcome_for(self, peer: bytes) -> Welcome:
        assert self._state.store is not None
        first = (
            self._state.generation == 0
        )  # the run's first world: from its start or its checkpoint
        return Welcome(
            rank=self._state.ranks[peer],
            world_size=len(self._state.members),
            run_id=self._state.attempt_id,
            backend=self._state.backend,
            store_host=self._state.store.host,
            store_port=self._state.store.port,
            start_epoch=self._state.run.start_epoch if first else self._state.epoch,
            epochs=self._state.config.epochs,
            resume_epoch=self._state.run.resume_epoch if first else self._restored_checkpoint(),
            checkpoint_dir=str(self._state.checkpoint_dir or ""),
            session=self._state.gate.sessions.issue(peer, ""),
            liveness=self._state.config.liveness,
            store_key=self._state.store.key,
            replica_check=self._state.config.replica_check,
            generation=self._state.generation,
            restore=self._restore_for(peer),
            elastic=self._state.config.elastic,
            understands=understood(),
            steps_per_epoch=self._state.config.steps_per_epoch,
            lr_steps=self._state.loop.schedule_rates(),
        )

    def _restored_checkpoint(self) -> int | None:
        """The checkpoint a new world loads (``welcome.resume_epoch``), if it restores one."""
        change = self._state.change
        return None if change is None else change.checkpoint

    def _restore_for(self, peer: bytes) -> str:
        """How ``peer`` takes the state of the epoch it starts (``welcome.restore``): nothing to
        restore in the run's first world; in a new one as the change decided, a newcomer from
        its peers unless every member loads the checkpoint."""
        change = self._state.change
        if change is None:
            return Restore.NONE.value if self._state.generation == 0 else Restore.MEMORY.value
        if change.restore is not Restore.CHECKPOINT and any(
            member.peer == peer for member in change.joined
        ):
            return Restore.PEERS.value
        return change.restore.value

    def welcome_all(self, now: float) -> list[Action]:
        state = self._state
        assert state.store is not None
        actions: list[Action] = [
            Send(m.peer, self.welcome_for(m.peer)) for m in self._state.members
        ]
        actions.append(
            Log(
                f"run {state.run_id}: {len(state.members)} workers, backend {state.backend}, "
                f"data-plane store at {printable(state.store.host)}:{state.store.port}"
            )
        )
        actions += [Log(line) for line in placement_lines(self._state.members)]
        self._state.set_phase(RunPhase.READY, now)
        return actions

    def check_rendezvous(self, now: float, waited: float) -> list[Action]:
        actions: list[Action] = []
        for peer in self._state.watchdog.silent(now):
            member = self._state.rendezvous.members.get(peer)
            if member is not None:
                actions.append(Log(f"{member.describe()} went silent during rendezvous; dropped"))
                self._state.rendezvous.leave(peer)
                self._state.gate.sessions.forget(peer)
            self._state.watchdog.drop(peer)
        if waited > self._state.config.rendezvous_timeout and not self._state.models.busy:
            cfg = self._state.config
            joined = len(self._state.rendezvous.members)
            return actions + self._state.abort(
                f"only {joined} of {cfg.world_size} workers joined within "
                f"{cfg.rendezvous_timeout:g} s: start the missing workers, or lower "
                f"--world-size{self._state.rendezvous_note()}"
            )
        return actions
