"""A restarted coordinator takes the run's running workers back where they are: no epoch redone.

The journal holds every decision whole, and every ``go`` that started an epoch from the ranks'
``epoch_ready`` (:class:`~epochal.coordinator.rules.carry.Carry`), each fsynced before any rank
heard
it. When the coordinator dies, every rank therefore either waits for the journal's last message or
got it and went on: into the next epoch, or into the checkpoint the decision asked for, where it
waits in a collective for the ranks that did not get it. Those say hello again to the restarted
coordinator first, naming the run they are in (``hello.run_id``); the others come once their
epoch is trained.

:class:`TakingBack` is the part of :class:`~epochal.coordinator.rules.machine.RunMachine` that
answers
them, in its rendezvous phase: each such hello is welcomed at once with ``carry_on`` (the worker
keeps its process group), the worker sends again what it waits an answer to, and the journal
answers it: the decision of the epoch before, or the go of the epoch; a report of the epoch under
way is kept for its decision, and rank 0's checkpointed commits the checkpoint the decision asked
for. Once every rank of the journaled world is back the run goes on in epoch ``carry.epoch``, as
if the coordinator had never stopped. A hello of a worker in no run (workers started again) takes
the other way, a resume from the last checkpoint; the first hello picks the way. It reads and
changes the run's facts in the :class:`~.machinestate.MachineState` it is given. Pure like the
machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epochal.coordinator.rules.actions import Action, Journal, Log, RunPhase, Send
from epochal.coordinator.rules.batches import BatchCounts, EpochPlan, format_ranks
from epochal.coordinator.rules.carry import Carry, replay
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.rendezvous import Admitted, Member
from epochal.protocol import (
    Checkpointed,
    EpochReady,
    EpochReport,
    Failed,
    Hello,
    Message,
    Welcome,
    understood,
)
from epochal.text import REASON_CHARS, printable

if TYPE_CHECKING:
    from epochal.coordinator.rules.epochs import Epochs
    from epochal.coordinator.rules.finishing import Finishing
    from epochal.coordinator.rules.machinestate import MachineState


class TakingBack:
    """The taking-back part of a run's machine; see the module docstring. ``epochs`` carries
    the run on in the epoch the journal left it in, ``finishing`` in its finish."""

    def __init__(self, state: MachineState, epochs: Epochs, finishing: Finishing) -> None:
        self._state = state
        self._epochs = epochs
        self._finishing = finishing

    @property
    def taking_back(self) -> bool:
        """Whether running workers are being taken back (the first came, not yet the last)."""
        return self._state.carry is not None and bool(self._state.taken)

    def takes_back(self, hello: Hello) -> bool:
        """Whether ``hello`` is taken back where its worker is: a worker of the run the journal
        holds, before any worker in no run began a rendezvous (which resumes the checkpoint)."""
        carry = self._state.carry
        return (
            carry is not None
            and self._state.phase is RunPhase.RENDEZVOUS
            and hello.run_id == carry.attempt_id
            and hello.rank_hint is not None
            and (self.taking_back or not self._state.rendezvous.members)
        )

    def take_back(self, now: float, peer: bytes, hello: Hello, user_id: str) -> list[Action]:
        """A worker of the journaled run says hello again: welcome it where it is."""
        carry = self._state.carry
        assert carry is not None and hello.rank_hint is not None
        rank = hello.rank_hint
        refused = self._state.gate.hello_refused(now, peer, hello, user_id)
        if refused is not None:
            return refused
        if rank >= carry.world_size:
            reason = (
                f"it was rank {rank}, but the run's world had {carry.world_size} workers when its "
                "coordinator stopped: start it again as a new worker"
            )
            return self._state.gate.reject(peer, reason, "refused")
        verdict = self._state.rendezvous.offer(peer, hello)
        if not isinstance(verdict, Admitted):
            self._state.rendezvous.leave(peer)
            why = getattr(verdict, "reason", "its model differs from the other workers'")
            return self._state.gate.reject(peer, printable(why, REASON_CHARS), "refused")
        self._state.watchdog.heard(peer, now)
        session = self._state.gate.sessions.issue(peer, user_id)
        actions: list[Action] = []
        if (
            not self._state.taken
        ):  # the first: the run carries on, its state as the journal holds it
            self._carry_state(carry)
            self._state.epoch_started = now  # when it began is the dead coordinator's to know
            where = "its finish" if carry.stopped else f"epoch {carry.epoch}"
            actions.append(
                Log(
                    f"run {self._state.run_id}: a worker of the run the journal holds said hello: "
                    f"taking its {carry.world_size} workers back where they are ({where}), nothing "
                    "redone"
                )
            )
        self._state.taken[rank] = member = Member(peer, hello)
        self._state.ranks[peer] = rank
        self._state.watchdog.phase_began(
            now
        )  # each worker back gives the others a new while to come
        return [*actions, Send(peer, self.carry_welcome(rank, session, member))]

    def _carry_state(self, carry: Carry) -> None:
        """The run's state as the journal holds it, for the run that carries on."""
        self._state.carried = carry
        self._state.loop = self._state.run.loop = carry.loop  # the status file reads the state's
        self._state.committed = [r["epoch"] for r in carry.records if r["kind"] == "checkpoint"]
        self._state.epoch, self._state.generation = carry.epoch, carry.generation
        self._state.world_changes = [
            {k: v for k, v in r.items() if k not in ("kind", "time")}
            for r in carry.records
            if r["kind"] == "world"
        ]
        if (
            self._state.config.elastic
        ):  # a world that loses a shard restores a checkpoint's loop state
            kept = set(self._state.committed)
            if carry.pending_checkpoint is not None:
                kept.add(carry.pending_checkpoint)
            for epoch in kept:
                loop = LoopState.from_config(self._state.config)
                loop.schedule = carry.loop.schedule  # as resumes kept it (steering.schedule_of)
                replay(loop, [r for r in carry.records if r["epoch"] <= epoch])
                self._state.loops_at[epoch] = loop

    def carry_welcome(self, rank: int, session: str, member: Member) -> Welcome:
        """The welcome that takes ``member`` back as ``rank`` of the journaled world (also the
        answer to its hello again, should this coordinator stall later: it has no store of its
        own to name)."""
        carry = self._state.carried
        assert carry is not None
        return Welcome(
            rank=rank,
            world_size=carry.world_size,
            run_id=self._state.attempt_id,
            backend=self._carry_backend(member),
            store_host=member.hello.host,  # not used: the worker keeps its store
            store_port=1,
            start_epoch=carry.epoch,
            epochs=self._state.config.epochs,
            resume_epoch=None,
            checkpoint_dir=str(self._state.checkpoint_dir or ""),
            session=session,
            liveness=self._state.config.liveness,
            replica_check=self._state.config.replica_check,
            generation=carry.generation,
            elastic=self._state.config.elastic,
            carry_on=True,
            understands=understood(),
            steps_per_epoch=self._state.config.steps_per_epoch,
            lr_steps=self._state.loop.schedule_rates(),
        )

    def _carry_backend(self, member: Member) -> str:
        """The backend of the world the worker keeps (as its rendezvous picked it)."""
        backend = self._state.config.backend
        if backend == "auto":
            backend = "nccl" if member.hello.device == "cuda" else "gloo"
        return backend

    def from_taken(self, now: float, peer: bytes, rank: int, message: Message) -> list[Action]:
        """What a worker taken back sends again (or anew) while the others are still coming."""
        carry = self._state.carry
        assert carry is not None
        decision = carry.decision
        if isinstance(message, EpochReady | EpochReport) and message.generation != carry.generation:
            return self._out_of_step(rank, message, carry)
        match message:  # heartbeats and statuses are the machine's, as for any member
            case EpochReport() if decision is not None and message.epoch == decision.epoch:
                if message.ready is not None:
                    self._state.copies[peer] = message.ready
                # it missed the decision (or, when the decision stopped the run, it may have had
                # it and waits for the finish): the journal's, exactly
                return [
                    Send(peer, decision),
                    Log(f"rank {rank} asked for the decision of epoch {decision.epoch} again"),
                    *self._is_back(now, rank),
                ]
            case EpochReady() if carry.gathering and message.epoch == carry.epoch:
                # it had the decision and gathered: its ready waits for a go (the newcomers the
                # dead coordinator held are gone, so the world stays as it is)
                self._state.copies[peer] = message
                self._state.ready[rank] = BatchCounts.of(message)
                return self._is_back(now, rank)
            case EpochReady() if (
                decision is None and carry.go is not None and message.epoch == carry.epoch
            ):
                self._state.copies[peer] = message
                return [  # it missed the go, or got it: the journal's, exactly
                    Send(peer, carry.go),
                    Log(f"rank {rank} asked for the go of epoch {carry.epoch} again"),
                    *self._is_back(now, rank),
                ]
            case EpochReport() if carry.go is not None and message.epoch == carry.epoch:
                self._epochs.note_report(now, peer, rank, message)
                return self._is_back(now, rank)
            case Checkpointed() if rank == 0:
                if message.epoch == carry.pending_checkpoint:  # on_checkpointed: once
                    return self._finishing.on_checkpointed(now, message.epoch)
                return []  # committed before the coordinator stopped
            case Failed():
                reason = printable(message.reason, REASON_CHARS)
                return self._state.abort(
                    f"rank {rank} ({self._state.taken[rank].describe()}) failed while the "
                    f"restarted coordinator took the workers back: {reason}"
                )
        return self._out_of_step(rank, message, carry)

    def _out_of_step(self, rank: int, message: Message, carry: Carry) -> list[Action]:
        return self._state.abort(
            f"rank {rank} sent {type(message).__name__} of epoch "
            f"{getattr(message, 'epoch', '?')} (world {getattr(message, 'generation', '?')}) to "
            f"the restarted coordinator, whose journal left the run in epoch {carry.epoch} "
            f"(world {carry.generation}): the worker and the journal are out of step (a journal "
            "from another run, or mixed epochal versions); start the workers again to resume "
            "from the last checkpoint"
        )

    def _is_back(self, now: float, rank: int) -> list[Action]:
        """``rank`` sent again what it waits an answer to: it is back where it was. Once every
        rank of the journaled world is, the run goes on there (not before: a rank whose message
        is still on its way may wait for the journal's answer, which only this state gives)."""
        carry = self._state.carry
        assert carry is not None
        if rank in self._state.back:
            return []
        self._state.back.add(rank)
        self._state.watchdog.phase_began(now)
        who, count = (
            self._state.taken[rank].describe(),
            f"{len(self._state.back)} of {carry.world_size}",
        )
        actions: list[Action] = [Log(f"rank {rank} ({who}) is back ({count})")]
        if len(self._state.back) < carry.world_size:
            return actions
        self._state.carry = None
        self._state.members = [self._state.taken[r] for r in range(carry.world_size)]
        self._state.backend = self._carry_backend(self._state.members[0])
        self._state.membership.form(tuple(self._state.members), generation=carry.generation)
        actions.append(
            Log(
                f"run {self._state.run_id}: every worker is back ({carry.world_size}); the run "
                f"carries on in {'its finish' if carry.stopped else f'epoch {carry.epoch}'}"
            )
        )
        if carry.stopped:
            return actions + self._finishing.finish(now)
        if carry.go is None:  # the ranks gathered: a go once every ready is in
            self._state.set_phase(RunPhase.READY, now)
            if len(self._state.ready) == len(self._state.members):
                actions += self._epochs.start_epoch(now)
            return actions
        self._state.plan = EpochPlan(carry.go.train_batches, carry.go.valid_batches)
        self._state.validates = carry.validates
        began = self._state.epoch_started
        self._epochs.run(now)
        self._state.epoch_started = began  # the epoch's seconds count from the first worker back
        if len(self._state.reports) == len(self._state.members):
            actions += self._epochs.decide(now)
        return actions

    def forget_carry(self) -> list[Action]:
        """Workers in no run began the rendezvous: they resume from the checkpoint, and the
        journal keeps the records up to it (kept whole until now, for a carry-on)."""
        if self._state.carry is None:
            return []
        self._state.carry = None
        return [Journal("rewrite", {"records": self._state.run.records})]

    def check_taking_back(self, now: float, waited: float) -> list[Action]:
        """A worker taken back that goes silent, or ranks that do not come back within
        ``--rendezvous-timeout``, end the run (its journal and checkpoints stay for a resume)."""
        carry = self._state.carry
        assert carry is not None
        for peer in self._state.watchdog.silent(now):
            rank = self._state.ranks.get(peer)
            if rank is not None:
                return self._state.abort(
                    f"rank {rank} ({self._state.taken[rank].describe()}) went silent while the "
                    "restarted coordinator took the workers back"
                )
            self._state.watchdog.drop(peer)
        limit, flag = self._back_within()
        if waited <= limit:
            return []
        missing = sorted(set(range(carry.world_size)) - self._state.back)
        return self._state.abort(
            f"{format_ranks(missing)} of the run did not come back to the restarted coordinator "
            f"within {limit:g} s ({flag}) of the last that did; the journal and the checkpoints "
            "are kept: start the workers again to resume from the last checkpoint"
        )

    def _back_within(self) -> tuple[float, str]:
        """How long a worker of the run may take to come back, and the flag that says so: a
        rank comes back once it has trained the epoch it was in (one that had the last decision
        trains the next), as long as the run lets an epoch go without progress (--stall-abort),
        or the rendezvous timeout where that is longer."""
        cfg = self._state.config
        if cfg.stall_abort is not None and cfg.stall_abort > cfg.rendezvous_timeout:
            return cfg.stall_abort, "--stall-abort"
        return cfg.rendezvous_timeout, "--rendezvous-timeout"

    def check_first_back(self, waited: float) -> list[Action]:
        """No worker has come yet to a coordinator whose journal could take them back: they may
        all be training an epoch; the same bound as for each later one, from the start."""
        limit, flag = self._back_within()
        if waited <= limit:
            return []
        return self._state.abort(
            f"no worker came back to the restarted coordinator within {limit:g} s ({flag}), and "
            "none was started again: start the workers (with the same --run-dir the run resumes "
            "from its last checkpoint)"
        )
