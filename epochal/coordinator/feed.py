"""What the coordinator tells its observers (status.json, TensorBoard, metrics), and when.

:class:`ObserverFeed` sits between the service and an :class:`~epochal.observe.RunObserver`: the
service notes what its actions did (a journal record written, a heartbeat sent, the result) and
calls :meth:`ObserverFeed.tell` once every action of a turn is carried out, so a decision is
never held up for an observer. After ``on_end`` the observers hear nothing more from this
coordinator. :func:`snapshot` is the run as they see it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epochal.coordinator.actions import RunPhase
from epochal.coordinator.loop import LoopState
from epochal.coordinator.machine import RunMachine
from epochal.observe import RankStatus, RunObserver, StatusSnapshot, World
from epochal.text import printable


def snapshot(
    machine: RunMachine, loop: LoopState, run_id: str, phase: RunPhase, now: float
) -> StatusSnapshot:
    """The run at ``now`` as the observers see it: phase, epoch, best so far, every rank's row."""
    heard = machine.watchdog.last_seen
    members = machine.members
    ranks = [
        RankStatus.from_row(row, now - heard.get(members[row[0]].peer, now))
        for row in machine.watchdog.rows(now, members)
    ]
    return StatusSnapshot(
        run_id=run_id,
        state=phase.value,
        epoch=machine.epoch,
        epochs=machine.config.epochs,
        world_size=machine.config.world_size,
        joined=len(machine.rendezvous.members),
        best_epoch=loop.best_epoch,
        best_loss=loop.best_loss,
        ranks=ranks,
        refused=machine.refused,
        round_seconds=machine.round_seconds,
    )


class ObserverFeed:
    """Collects what a turn's actions did and tells the observers once the turn is done."""

    def __init__(self, observers: RunObserver) -> None:
        self.observers = observers
        self.ended = False
        # the observers heard on_end: they hear nothing more from this coordinator
        self._epochs: list[dict[str, Any]] = []
        # journal records written by the actions being applied, told once they all are
        self._joined = (0, 0)
        # (workers joined, ranks assigned) as last told
        self._beat = False
        # a heartbeat went out: the observers get a snapshot

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
        the run has no outcome: ``running``) a snapshot; after the end, nothing."""
        records, self._epochs = self._epochs, []
        beat, self._beat = self._beat, False
        if self.ended or machine is None:
            return
        joined = (len(machine.rendezvous.members), len(machine.members))
        if joined != self._joined:
            self._joined = joined
            hosts = tuple(printable(m.hello.host) for m in machine.members)
            self.observers.on_join(World(joined[0], machine.config.world_size, hosts))
        if not (records or beat) or not self.observers:
            return
        status = make_snapshot()
        for record in records:
            self.observers.on_epoch(record, status)
        if beat and running:
            self.observers.on_status(status)

    def end(
        self,
        result: dict[str, Any],
        machine: RunMachine | None,
        make_snapshot: Callable[[], StatusSnapshot],
    ) -> None:
        """The result is written: what came before it first, then ``on_end``, the last word."""
        if self.ended:
            return
        self.tell(machine, True, make_snapshot)
        self.ended = True
        self.observers.on_end(result)
