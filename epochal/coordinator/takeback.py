"""A restarted coordinator takes the run's running workers back where they are: no epoch redone.

The journal holds every decision whole, and every ``go`` that started an epoch from the ranks'
``epoch_ready`` (:class:`~epochal.coordinator.carry.Carry`), each fsynced before any rank heard
it. When the coordinator dies, every rank therefore either waits for the journal's last message or
got it and went on: into the next epoch, or into the checkpoint the decision asked for, where it
waits in a collective for the ranks that did not get it. Those say hello again to the restarted
coordinator first, naming the run they are in (``hello.run_id``); the others come once their
epoch is trained.

:class:`TakingBack` is the part of :class:`~epochal.coordinator.machine.RunMachine` that answers
them, in its rendezvous phase: each such hello is welcomed at once with ``carry_on`` (the worker
keeps its process group), the worker sends again what it waits an answer to, and the journal
answers it: the decision of the epoch before, or the go of the epoch; a report of the epoch under
way is kept for its decision, and rank 0's checkpointed commits the checkpoint the decision asked
for. Once every rank of the journaled world is back the run goes on in epoch ``carry.epoch``, as
if the coordinator had never stopped. A hello of a worker in no run (workers started again) takes
the other way, a resume from the last checkpoint; the first hello picks the way. Pure like the
machine.
"""

from __future__ import annotations

from epochal.coordinator.actions import Action, Journal, Log, RunPhase, Send
from epochal.coordinator.batches import BatchCounts, EpochPlan, format_ranks
from epochal.coordinator.carry import Carry, replay
from epochal.coordinator.loop import LoopState
from epochal.coordinator.regrouping import Regrouping
from epochal.coordinator.rendezvous import Admitted, Member
from epochal.coordinator.sums import LossSums
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


class TakingBack(Regrouping):
    """The taking-back side of a run's machine; see the module docstring. The machine sets every
    attribute below in its ``__init__``."""

    _carry: Carry | None
    _taken: dict[int, Member]
    _back: set[int]
    _carried: Carry | None
    _plan: EpochPlan | None
    _validates: bool
    _reports: dict[int, LossSums]
    _epoch_started: float

    def _note_report(self, now: float, peer: bytes, rank: int, report: EpochReport) -> None:
        raise NotImplementedError  # the machine's

    def _decide(self, now: float) -> list[Action]:
        raise NotImplementedError  # the machine's

    def _run(self, now: float) -> None:
        raise NotImplementedError  # the machine's

    def _start_epoch(self, now: float) -> list[Action]:
        raise NotImplementedError  # the machine's

    def _finish(self, now: float, *, decided: bool = True) -> list[Action]:
        raise NotImplementedError  # the machine's

    def _on_checkpointed(self, now: float, epoch: int) -> list[Action]:
        raise NotImplementedError  # the machine's

    @property
    def taking_back(self) -> bool:
        """Whether running workers are being taken back (the first came, not yet the last)."""
        return self._carry is not None and bool(self._taken)

    def _phase_began(self, now: float) -> None:
        self.watchdog.phase_began(now)

    def takes_back(self, hello: Hello) -> bool:
        """Whether ``hello`` is taken back where its worker is: a worker of the run the journal
        holds, before any worker in no run began a rendezvous (which resumes the checkpoint)."""
        carry = self._carry
        return (
            carry is not None
            and self.phase is RunPhase.RENDEZVOUS
            and hello.run_id == carry.run_id
            and hello.rank_hint is not None
            and (self.taking_back or not self.rendezvous.members)
        )

    def _take_back(self, now: float, peer: bytes, hello: Hello, user_id: str) -> list[Action]:
        """A worker of the journaled run says hello again: welcome it where it is."""
        carry = self._carry
        assert carry is not None and hello.rank_hint is not None
        rank = hello.rank_hint
        refused = self.gate.hello_refused(now, peer, hello, user_id)
        if refused is not None:
            return refused
        if rank >= carry.world_size:
            reason = (
                f"it was rank {rank}, but the run's world had {carry.world_size} workers when its "
                "coordinator stopped: start it again as a new worker"
            )
            return self.gate.reject(peer, reason, "refused")
        verdict = self.rendezvous.offer(peer, hello)
        if not isinstance(verdict, Admitted):
            self.rendezvous.leave(peer)
            why = getattr(verdict, "reason", "its model differs from the other workers'")
            return self.gate.reject(peer, printable(why, REASON_CHARS), "refused")
        self.watchdog.heard(peer, now)
        session = self.gate.sessions.issue(peer, user_id)
        actions: list[Action] = []
        if not self._taken:  # the first: the run carries on, its state as the journal holds it
            self._carry_state(carry)
            self._epoch_started = now  # when it began is the dead coordinator's to know
            where = "its finish" if carry.stopped else f"epoch {carry.epoch}"
            actions.append(
                Log(
                    f"run {self.run_id}: a worker of the run the journal holds said hello: taking "
                    f"its {carry.world_size} workers back where they are ({where}), nothing redone"
                )
            )
        self._taken[rank] = member = Member(peer, hello)
        self._ranks[peer] = rank
        self._phase_began(now)  # each worker back gives the others a new while to come
        return [*actions, Send(peer, self.carry_welcome(rank, session, member))]

    def _carry_state(self, carry: Carry) -> None:
        """The run's state as the journal holds it, for the run that carries on."""
        self._carried = carry
        self._loop = self._state.loop = carry.loop  # the status file reads the state's
        self._committed = [r["epoch"] for r in carry.records if r["kind"] == "checkpoint"]
        self.epoch, self.generation = carry.epoch, carry.generation
        self.world_changes = [
            {k: v for k, v in r.items() if k not in ("kind", "time")}
            for r in carry.records
            if r["kind"] == "world"
        ]
        if self.config.elastic:  # a world that loses a shard restores a checkpoint's loop state
            kept = set(self._committed)
            if carry.pending_checkpoint is not None:
                kept.add(carry.pending_checkpoint)
            for epoch in kept:
                loop = LoopState.from_config(self.config)
                replay(loop, [r for r in carry.records if r["epoch"] <= epoch])
                self._loops_at[epoch] = loop

    def carry_welcome(self, rank: int, session: str, member: Member) -> Welcome:
        """The welcome that takes ``member`` back as ``rank`` of the journaled world (also the
        answer to its hello again, should this coordinator stall later: it has no store of its
        own to name)."""
        carry = self._carried
        assert carry is not None
        return Welcome(
            rank=rank,
            world_size=carry.world_size,
            run_id=self.run_id,
            backend=self._carry_backend(member),
            store_host=member.hello.host,  # not used: the worker keeps its store
            store_port=1,
            start_epoch=carry.epoch,
            epochs=self.config.epochs,
            resume_epoch=None,
            checkpoint_dir=str(self._checkpoint_dir or ""),
            session=session,
            liveness=self.config.liveness,
            replica_check=self.config.replica_check,
            generation=carry.generation,
            elastic=self.config.elastic,
            carry_on=True,
            understands=understood(),
        )

    def _carry_backend(self, member: Member) -> str:
        """The backend of the world the worker keeps (as its rendezvous picked it)."""
        backend = self.config.backend
        if backend == "auto":
            backend = "nccl" if member.hello.device == "cuda" else "gloo"
        return backend

    def _from_taken(self, now: float, peer: bytes, rank: int, message: Message) -> list[Action]:
        """What a worker taken back sends again (or anew) while the others are still coming."""
        carry = self._carry
        assert carry is not None
        decision = carry.decision
        if isinstance(message, EpochReady | EpochReport) and message.generation != carry.generation:
            return self._out_of_step(rank, message, carry)
        match message:  # heartbeats and statuses are the machine's, as for any member
            case EpochReport() if decision is not None and message.epoch == decision.epoch:
                if message.ready is not None:
                    self._copies[peer] = message.ready
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
                self._copies[peer] = message
                self._ready[rank] = BatchCounts(message.train_batches, message.valid_batches)
                return self._is_back(now, rank)
            case EpochReady() if (
                decision is None and carry.go is not None and message.epoch == carry.epoch
            ):
                self._copies[peer] = message
                return [  # it missed the go, or got it: the journal's, exactly
                    Send(peer, carry.go),
                    Log(f"rank {rank} asked for the go of epoch {carry.epoch} again"),
                    *self._is_back(now, rank),
                ]
            case EpochReport() if carry.go is not None and message.epoch == carry.epoch:
                self._note_report(now, peer, rank, message)
                return self._is_back(now, rank)
            case Checkpointed() if rank == 0:
                if message.epoch == carry.pending_checkpoint:  # _on_checkpointed: once
                    return self._on_checkpointed(now, message.epoch)
                return []  # committed before the coordinator stopped
            case Failed():
                reason = printable(message.reason, REASON_CHARS)
                return self.abort(
                    f"rank {rank} ({self._taken[rank].describe()}) failed while the restarted "
                    f"coordinator took the workers back: {reason}"
                )
        return self._out_of_step(rank, message, carry)

    def _out_of_step(self, rank: int, message: Message, carry: Carry) -> list[Action]:
        return self.abort(
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
        carry = self._carry
        assert carry is not None
        if rank in self._back:
            return []
        self._back.add(rank)
        self._phase_began(now)
        who, count = self._taken[rank].describe(), f"{len(self._back)} of {carry.world_size}"
        actions: list[Action] = [Log(f"rank {rank} ({who}) is back ({count})")]
        if len(self._back) < carry.world_size:
            return actions
        self._carry = None
        self.members = [self._taken[r] for r in range(carry.world_size)]
        self._backend = self._carry_backend(self.members[0])
        self.membership.form(tuple(self.members), generation=carry.generation)
        actions.append(
            Log(
                f"run {self.run_id}: every worker is back ({carry.world_size}); the run carries "
                f"on in {'its finish' if carry.stopped else f'epoch {carry.epoch}'}"
            )
        )
        if carry.stopped:
            return actions + self._finish(now)
        if carry.go is None:  # the ranks gathered: a go once every ready is in
            self._set_phase(RunPhase.READY, now)
            if len(self._ready) == len(self.members):
                actions += self._start_epoch(now)
            return actions
        self._plan = EpochPlan(carry.go.train_batches, carry.go.valid_batches)
        self._validates = carry.validates
        began = self._epoch_started
        self._run(now)
        self._epoch_started = began  # the epoch's seconds count from the first worker back
        if len(self._reports) == len(self.members):
            actions += self._decide(now)
        return actions

    def _forget_carry(self) -> list[Action]:
        """Workers in no run began the rendezvous: they resume from the checkpoint, and the
        journal keeps the records up to it (kept whole until now, for a carry-on)."""
        if self._carry is None:
            return []
        self._carry = None
        return [Journal("rewrite", {"records": self._state.records})]

    def _check_taking_back(self, now: float, waited: float) -> list[Action]:
        """A worker taken back that goes silent, or ranks that do not come back within
        ``--rendezvous-timeout``, end the run (its journal and checkpoints stay for a resume)."""
        carry = self._carry
        assert carry is not None
        for peer in self.watchdog.silent(now):
            rank = self._ranks.get(peer)
            if rank is not None:
                return self.abort(
                    f"rank {rank} ({self._taken[rank].describe()}) went silent while the restarted "
                    "coordinator took the workers back"
                )
            self.watchdog.drop(peer)
        limit, flag = self._back_within()
        if waited <= limit:
            return []
        missing = sorted(set(range(carry.world_size)) - self._back)
        return self.abort(
            f"{format_ranks(missing)} of the run did not come back to the restarted coordinator "
            f"within {limit:g} s ({flag}) of the last that did; the journal and the checkpoints "
            "are kept: start the workers again to resume from the last checkpoint"
        )

    def _back_within(self) -> tuple[float, str]:
        """How long a worker of the run may take to come back, and the flag that says so: a
        rank comes back once it has trained the epoch it was in (one that had the last decision
        trains the next), as long as the run lets an epoch go without progress (--stall-abort),
        or the rendezvous timeout where that is longer."""
        cfg = self.config
        if cfg.stall_abort is not None and cfg.stall_abort > cfg.rendezvous_timeout:
            return cfg.stall_abort, "--stall-abort"
        return cfg.rendezvous_timeout, "--rendezvous-timeout"

    def _check_first_back(self, waited: float) -> list[Action]:
        """No worker has come yet to a coordinator whose journal could take them back: they may
        all be training an epoch; the same bound as for each later one, from the start."""
        limit, flag = self._back_within()
        if waited <= limit:
            return []
        return self.abort(
            f"no worker came back to the restarted coordinator within {limit:g} s ({flag}), and "
            "none was started again: start the workers (with the same --run-dir the run resumes "
            "from its last checkpoint)"
        )
