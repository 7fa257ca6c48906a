"""What the coordinator tells its observers (status.json, TensorBoard, metrics), and when.

:class:`ObserverFeed` sits between the service and an :class:`~epochal.observe.RunObserver`: the
service tells it the run started (:meth:`ObserverFeed.started`), notes what its actions did (a
journal record written, a heartbeat sent, the result) and calls :meth:`ObserverFeed.tell` once every
action of a turn is carried out, so a decision is never held up for an observer (and the service's
observer hands each call to a thread: :class:`~epochal.coordinator.serve.diskwork.OffLoop`). After
``on_end`` the observers hear nothing more from this coordinator. :func:`snapshot` is the run as
they see it: one epoch for the run and its ranks (:func:`rank_at`), so status.json's header and its
rows never tell two stories.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.actions import RunPhase
from epochal.coordinator.rules.batches import EpochPlan
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.watchdog import RankStatus as WatchedStatus
from epochal.coordinator.serve.resume import config_record
from epochal.observe import RankStatus, RunObserver, RunStart, StatusSnapshot, World
from epochal.protocol import Awaiting, Phase
from epochal.text import printable

STARTING = "starting"
"""A rank's phase, as the observers show it, once the coordinator has sent it the Go of the epoch
it is to train and before the rank has said more (it may write a checkpoint first)."""

UNHEARD = "?"
"""The phase of a rank not heard from since the ranks were assigned."""


def rank_at(said: WatchedStatus | None, run_phase: RunPhase, run_epoch: int) -> tuple[str, int]:
    """(phase, epoch) of a rank as the coordinator knows it at the moment: what the rank last
    ``said``, unless that is a wait the coordinator has since answered.

    A rank that reported epoch e waits for e's decision; once the decision is out it carries
    the Go of e + 1, which the run (``run_epoch``) now runs: the rank is ``starting`` e + 1, not
    waiting in e. After the last decision (``run_phase`` finishing) it is finishing e. A rank
    waiting for the Go of the epoch the run now runs has it too. A rank never heard is at the
    run's epoch, not at epoch 0.
    """
    if said is None:
        return UNHEARD, run_epoch
    if said.phase != Phase.WAITING:
        return said.phase, said.epoch
    if said.awaiting == Awaiting.DECISION:
        if said.epoch < run_epoch:
            return STARTING, run_epoch
        if run_phase in (RunPhase.FINISHING, RunPhase.ENDED):
            return Phase.FINISHING.value, said.epoch
    if said.awaiting == Awaiting.GO and said.epoch == run_epoch and run_phase is RunPhase.RUNNING:
        return STARTING, run_epoch
    return said.phase, said.epoch


def snapshot(
    machine: RunMachine, loop: LoopState, run_id: str, phase: RunPhase, now: float
) -> StatusSnapshot:
    """The run at ``now`` as the observers see it: phase, epoch, best so far, every rank's row."""
    dog = machine.watchdog
    heard = dog.last_seen
    members = machine.members
    ranks = []
    plan = machine.plan if phase is RunPhase.RUNNING else None
    said, epoch = dog.status.get, machine.epoch
    for rank, host, _, _, step, idle, where in dog.rows(now, members):
        rank_phase, rank_epoch = rank_at(said(rank), phase, epoch)
        last_heard = now - heard.get(members[rank].peer, now)
        steps = phase_steps(plan, rank_phase, rank_epoch, epoch)
        ranks.append(
            RankStatus(rank, host, rank_phase, rank_epoch, step, idle, where, last_heard, steps)
        )
    return StatusSnapshot(
        run_id=run_id,
        state=phase.value,
        epoch=machine.epoch,
        epochs=machine.config.epochs,
        world_size=len(machine.members) or machine.config.world_size,  # the world of now
        joined=len(machine.rendezvous.members),
        best_epoch=loop.best_epoch,
        best_loss=loop.best_loss,
        ranks=ranks,
        refused=machine.refused,
        round_seconds=machine.round_seconds,
        epoch_ends_in=epoch_ends_in(plan, ranks, now - machine.epoch_started),
    )


def phase_steps(plan: EpochPlan | None, phase: str, epoch: int, run_epoch: int) -> int | None:
    """How many steps a rank's ``phase`` of ``epoch`` has, when that is the epoch the run runs
    by ``plan``: its train or its validation batches; None otherwise."""
    if plan is None or epoch != run_epoch:
        return None
    if phase == Phase.TRAIN:
        return plan.train_batches
    if phase == Phase.VALIDATE:
        return plan.valid_batches or None
    return None


def epoch_ends_in(plan: EpochPlan | None, ranks: list[RankStatus], elapsed: float) -> float | None:
    """Seconds until the epoch under way ends (``elapsed`` seconds since it began), at the rate
    its slowest rank in training or validation went so far, all batches counted alike; None
    before such a rank made a step."""
    if plan is None:
        return None
    done = [
        rank.step + (plan.train_batches if rank.phase == Phase.VALIDATE else 0)
        for rank in ranks
        if rank.steps is not None  # training or validating this epoch: the others set no rate
    ]
    total = plan.train_batches + plan.valid_batches
    slowest = min(done, default=0)
    if slowest <= 0:
        return None
    return max(0.0, elapsed * (total - slowest) / slowest)


SNAPSHOT_SHARE = 0.05
"""The most of the coordinator's time that building snapshots for the observers may take.

A snapshot has a row for every rank: at thousands of ranks it takes milliseconds, and a run of
short epochs (or a burst of heartbeats) would otherwise build one several times a second. After
a snapshot that took ``t``, the next waits ``t * (1 - share) / share``; what was written
meanwhile waits with it, in order, and the observers hear it with that next snapshot (at the
latest with the result: :meth:`ObserverFeed.end`). Under a hundred ranks a snapshot takes well
under a millisecond, so the wait is shorter than a turn of the service and nothing waits."""


JOIN_TELL_SECONDS = 0.5
"""Least time between two tellings of how many workers a rendezvous holds. Each telling is a job
for the observers' thread, which wakes it and hands it the interpreter: at 4,096 workers a job
per hello took about a tenth of the rendezvous (``bench/control_plane.py``). The count that
completes the set, a fall in it and any change of the ranks are told at once; a count held
back is told at the first turn after the wait (a turn tells even when it did nothing)."""


class ObserverFeed:
    """Collects what a turn's actions did and tells the observers once the turn is done.

    ``clock``: the processor-independent clock that times snapshots (a test's own)."""

    def __init__(
        self, observers: RunObserver, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.observers = observers
        self._clock = clock
        self._next_snapshot = float("-inf")
        # no snapshot before this clock reading (SNAPSHOT_SHARE)
        self.ended = False
        # the observers heard on_end: they hear nothing more from this coordinator
        self._epochs: list[dict[str, Any]] = []
        # journal records written by the actions being applied, told once they all are
        self._joined = (0, 0)
        # (workers joined, ranks assigned) as last told
        self._joined_told = float("-inf")
        # when they were (JOIN_TELL_SECONDS)
        self._beat = False
        # a heartbeat went out: the observers get a snapshot

    def started(
        self,
        config: CoordinatorConfig,
        run_id: str,
        endpoint: str,
        attempt: int,
        resumed_from: int | None,
    ) -> None:
        """The run starts (``attempt`` 0, or again after a failure), listening at ``endpoint``."""
        start = RunStart(
            run_id=run_id,
            run_dir=config.run_dir,
            endpoint=endpoint,
            world_size=config.world_size,
            epochs=config.epochs,
            attempt=attempt,
            resumed_from=resumed_from,
            config=config_record(config),
        )
        self.observers.on_start(start)

    def written(self, record: dict[str, Any]) -> None:
        """An epoch (or checkpoint) record reached the journal."""
        self._epochs.append(record)

    def heartbeat_sent(self) -> None:
        self._beat = True

    def tell(
        self,
        machine: RunMachine | None,
        running: bool,
        make_snapshot: Callable[[], StatusSnapshot],
    ) -> None:
        """The records just written, a change in who has joined, and (after a heartbeat, while
        the run has no outcome: ``running``) a snapshot; after the end, nothing. Records and a
        heartbeat wait for the next turn while a snapshot is not due (:data:`SNAPSHOT_SHARE`)."""
        if self.ended or machine is None:
            self._epochs, self._beat = [], False
            return
        joined = (len(machine.rendezvous.members), len(machine.members))
        if joined != self._joined and self._join_due(joined, machine.config.world_size):
            self._joined, self._joined_told = joined, self._clock()
            hosts = tuple(printable(m.hello.host) for m in machine.members)
            self.observers.on_join(World(joined[0], machine.config.world_size, hosts))
        if not (self._epochs or self._beat) or not self.observers:
            self._epochs, self._beat = [], False
            return
        started = self._clock()
        if started < self._next_snapshot:
            return  # told at a later turn, with a snapshot of then
        records, self._epochs = self._epochs, []
        beat, self._beat = self._beat, False
        status = make_snapshot()
        took = self._clock() - started
        self._next_snapshot = started + took / SNAPSHOT_SHARE
        for record in records:
            self.observers.on_epoch(record, status)
        if beat and running:
            self.observers.on_status(status)

    def _join_due(self, joined: tuple[int, int], world_size: int) -> bool:
        """Whether the change of ``joined`` from what was told is to be told now."""
        workers, ranks = joined
        return (
            ranks != self._joined[1]
            or workers >= world_size
            or workers < self._joined[0]
            or self._clock() - self._joined_told >= JOIN_TELL_SECONDS
        )

    def end(
        self,
        result: dict[str, Any],
        machine: RunMachine | None,
        make_snapshot: Callable[[], StatusSnapshot],
    ) -> None:
        """The result is written: what came before it first, then ``on_end``, the last word."""
        if self.ended:
            return
        self._next_snapshot = float("-inf")  # whatever waits is told now, before the end
        self.tell(machine, True, make_snapshot)
        self.ended = True
        self.observers.on_end(result)
