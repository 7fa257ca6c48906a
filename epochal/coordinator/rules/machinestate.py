"""What a run's machine knows, in one object its parts share.

:class:`MachineState` holds the run's facts (its phase, members, ranks, epoch, world, what each
rank said of the epoch under way, where a restarted coordinator takes the run back from) and the
small rule objects that keep their own (:class:`~.rendezvous.Rendezvous`, :class:`~.strangers.Gate`,
:class:`~.watchdog.Watchdog`, :class:`~.membership.Membership`, :class:`~.models.ModelChecks`).
The parts of :class:`~epochal.coordinator.rules.machine.RunMachine` (:mod:`.joining`,
:mod:`.regrouping`,
:mod:`.takeback`, :mod:`.epochs`, :mod:`.finishing`) each get this object and change it; none keeps
a copy of a fact another part may change. Its few methods are the steps every part takes alike
(a new phase, the end of the run by abort). Pure: no clock, socket or file.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules import runstate
from epochal.coordinator.rules.actions import Aborted, Action, Broadcast, Journal, Log, RunPhase
from epochal.coordinator.rules.batches import BatchCounts, EpochPlan, last_plan
from epochal.coordinator.rules.carry import Carry
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.membership import Membership, NewWorld
from epochal.coordinator.rules.models import ModelChecks, ModelRecord
from epochal.coordinator.rules.rendezvous import JoinLog, Member, Rendezvous
from epochal.coordinator.rules.strangers import Gate
from epochal.coordinator.rules.sums import LossSums
from epochal.coordinator.rules.watchdog import Watchdog
from epochal.protocol import Abort, EpochReady, SnapshotScope, StoreReady, clip

if TYPE_CHECKING:
    from pathlib import Path


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class MachineState:
    """One run's control-plane facts; see the module docstring. :meth:`start` makes the first."""

    config: CoordinatorConfig
    run_id: str
    # the run's, in what the user reads
    attempt_id: str
    # what this attempt's workers know the run by, in what they are sent (.attempts)
    run: runstate.RunState
    # what the run directory held when the coordinator started (journal, checkpoint, carry)
    loop: LoopState
    # the epoch loop's state: smoothing, best epoch, lr factor, history (the run state's own)
    models: ModelChecks
    # between workers, and against the run directory: parameter lists fetched page by page
    rendezvous: Rendezvous
    joins: JoinLog
    gate: Gate
    watchdog: Watchdog
    membership: Membership
    rendezvous_note: Callable[[], str]
    # why a rendezvous may fall short besides missing workers (refused CURVE handshakes)
    checkpoint_dir: Path | None
    epoch: int
    epoch_started: float
    round_started: float
    next_heartbeat: float
    committed: list[int]
    # the epochs whose checkpoints are committed (and not pruned)
    carry: Carry | None
    # where the journal left the run, for running workers that come back (takeback.py)
    phase: RunPhase = RunPhase.RENDEZVOUS
    ranks: dict[bytes, int] = dataclasses.field(default_factory=dict)
    members: list[Member] = dataclasses.field(default_factory=list)
    # by rank, once the ranks are assigned
    backend: str = "gloo"
    store: StoreReady | None = None
    ready: dict[int, BatchCounts] = dataclasses.field(default_factory=dict)
    # phase ready: the batch counts of every rank's epoch_ready so far
    reports: dict[int, LossSums] = dataclasses.field(default_factory=dict)
    next_counts: dict[int, BatchCounts] = dataclasses.field(default_factory=dict)
    # phase running: the batch counts for the next epoch that the loss reports carried
    rates: dict[int, float | None] = dataclasses.field(default_factory=dict)
    # phase running: the learning rate each rank's optimizer held, where it said it
    checksums: dict[int, int | None] = dataclasses.field(default_factory=dict)
    # phase running: each rank's checksum of its weights after the epoch, where it sent one
    done: set[int] = dataclasses.field(default_factory=set)
    finish_decided: bool = True
    # the Finish followed the last epoch's decision
    plan: EpochPlan | None = None
    validates: bool = False
    over: bool = False
    # an outcome (Finished or Aborted) has been returned
    refused: int = 0
    # hellos refused by the rendezvous (wrong job or token, surplus, duplicate), for observers
    round_seconds: float | None = None
    # the last epoch's control round: from its first loss report to its decision
    generation: int = 0
    # the world's: one more with each change (regrouping.py)
    world_changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    change: NewWorld | None = None
    # the change whose world is forming
    copies: dict[bytes, EpochReady] = dataclasses.field(default_factory=dict)
    # each member's last ready: what its copy of an epoch's start holds, and whether it
    # gathers its part of the state when a decision asks (elastic)
    gathering: int | None = None
    # the epoch whose start the members gather onto rank 0 (Decision.gather): the world
    # grows once their readies of it are in
    loops_at: dict[int, LoopState] = dataclasses.field(default_factory=dict)
    # elastic: the loop state as each checkpoint holds it, for a world that restores one
    taken: dict[int, Member] = dataclasses.field(default_factory=dict)
    # by rank, the workers taken back so far (welcomed)
    back: set[int] = dataclasses.field(default_factory=set)
    # the ranks taken back that sent again what they wait an answer to
    carried: Carry | None = None
    # where the run was taken back from, once it was

    @classmethod
    def start(
        cls,
        config: CoordinatorConfig,
        run: runstate.RunState,
        *,
        run_id: str,
        attempt_id: str,
        now: float,
        model_record: ModelRecord | None,
        rendezvous_note: Callable[[], str],
    ) -> MachineState:
        """The state of a run that begins its rendezvous at ``now``, from what ``run`` held."""
        state = cls(
            config=config,
            run_id=run_id,
            attempt_id=attempt_id,
            run=run,
            loop=run.loop,
            models=ModelChecks(model_record),
            rendezvous=Rendezvous(config),
            joins=JoinLog(config.world_size),
            gate=Gate(),
            watchdog=Watchdog(config, now),
            membership=Membership(config.least_workers, config.world_size),
            rendezvous_note=rendezvous_note,
            checkpoint_dir=config.checkpoint_path,
            epoch=run.start_epoch,
            epoch_started=now,
            round_started=now,
            next_heartbeat=now,
            committed=[r["epoch"] for r in run.records if r["kind"] == "checkpoint"],
            carry=run.carry,
            plan=last_plan(run.records),  # a resume's first epoch compares its plan with it
        )
        if config.elastic and run.resume_epoch is not None:
            state.loops_at[run.resume_epoch] = copy.deepcopy(run.loop)
        return state

    @property
    def scope(self) -> SnapshotScope:
        """What the members' copies of an epoch's start hold together, as their readies said."""
        return SnapshotScope.least(
            self.copies[m.peer].snapshots for m in self.members if m.peer in self.copies
        )

    def set_phase(self, phase: RunPhase, now: float) -> None:
        """The run enters ``phase`` at ``now``: the watchdog times it from there."""
        self.phase = phase
        self.watchdog.phase_began(now)

    def recipients(self) -> tuple[bytes, ...]:
        """Who a broadcast goes to: the members, or before the ranks are assigned, the joined."""
        if self.members:
            return tuple(m.peer for m in self.members)
        return tuple(self.rendezvous.members)

    def clear_round(self) -> None:
        """Forget what the ranks of a world that is gone said of the current epoch."""
        self.ready.clear()
        self.reports.clear()
        self.next_counts.clear()
        self.checksums.clear()
        self.rates.clear()
        self.done.clear()

    def abort(self, reason: str, *, force: bool = False, needs_fix: bool = False) -> list[Action]:
        """End the run: Abort to every worker, the reason recorded. ``force``: also after an
        outcome, when its record could not be written. ``needs_fix``: a configuration or data
        error, which a resume would repeat (:attr:`RunAborted.needs_fix`)."""
        if self.over and not force:
            return []
        self.over = True
        return [
            Log(f"run aborted: {reason}"),
            Broadcast(self.recipients(), Abort(reason=clip(reason))),
            Journal("result", {"status": "aborted", "run_id": self.run_id, "reason": reason}, True),
            Aborted(reason, needs_fix=needs_fix),
        ]
