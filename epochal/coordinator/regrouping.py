"""How a run goes on without a lost worker: the world's changes at the coordinator.

:class:`Regrouping` is the part of :class:`~epochal.coordinator.machine.RunMachine` (between it
and :class:`~.joining.Joining` in its bases) that runs when the run is elastic (``--min-workers``
below the world size) and a rank is lost: its process exited (:meth:`Regrouping.process_exited`,
told by the launcher), its connection closed (:meth:`Regrouping.connection_closed`), it failed,
or it went silent past the heartbeat timeout. The losses that come together are collected for a
moment (:data:`~.membership.LOSS_SETTLE`; the lost rank's peers then report their broken
collectives, which are consequences, not failures of their own), and :class:`~.membership.
Membership` decides: the survivors in their order, renumbered, as the next generation's world,
or the end of the run when fewer than ``--min-workers`` remain.

A new world forms as the first one did, under its generation: ``regroup`` to every survivor,
``open_store`` to its rank 0, and on ``store_ready`` a ``welcome`` to every member; each starts the
interrupted epoch again from the state it held at the epoch's start (``restore`` memory) and says
``epoch_ready``; the epoch's ``go`` follows. Nothing of the interrupted epoch was decided, so the
loop state stands as it was. Each change is one log line, one journal record (``kind`` world) and
one entry of the result's ``world_changes``. Pure like the machine.
"""

from __future__ import annotations

from typing import Any

from epochal.coordinator.actions import Action, Journal, Log, RunPhase, Send
from epochal.coordinator.joining import Joining
from epochal.coordinator.membership import Membership, NewWorld, Snapshots, TooFew
from epochal.protocol import Abort, Broken, OpenStore, Regroup, clip
from epochal.text import REASON_CHARS, printable


class Regrouping(Joining):
    """The elastic side of a run's machine; see the module docstring. The machine sets every
    attribute below in its ``__init__``."""

    membership: Membership
    over: bool
    generation: int
    epoch: int
    world_changes: list[dict[str, Any]]
    _change: NewWorld | None
    _redo: int | None

    def _clear_round(self) -> None:
        raise NotImplementedError  # the machine's

    # ------------------------------------------------------------------ losses

    @property
    def elastic(self) -> bool:
        """Whether a lost rank's peers carry on (while at least ``--min-workers`` remain)."""
        return self.config.elastic and self.phase in (
            RunPhase.STORE,
            RunPhase.READY,
            RunPhase.RUNNING,
        )

    def lose(self, now: float, rank: int, why: str) -> bool:
        """``rank`` is lost, ``why``; True when the run goes on without it (elastic), False when
        the caller must treat it as a failure of the run."""
        if not self.elastic or self.over:
            return False
        self.membership.lose(now, rank, why)
        return True

    def process_exited(self, now: float, pid: int, what: str) -> bool:
        """A worker process of this machine (``pid``) exited, ``what``; True when a rank was lost
        and the run goes on without it."""
        for rank, member in enumerate(self.members):
            if member.hello.pid == pid:
                return self.lose(now, rank, what)
        # already lost (its connection closed first): the run goes on without it, and its exit
        # says why better than the closed connection did
        if not self.config.elastic or not self.membership.lost_pid(pid):
            return False
        self.membership.explain(pid, what)
        return True

    def connection_closed(self, now: float, peer: bytes) -> None:
        """A member's connection closed: in an elastic run, its rank is lost."""
        rank = self._ranks.get(peer)
        if rank is not None:
            self.lose(now, rank, "closed its connection to the coordinator")

    def _on_broken(self, now: float, rank: int, message: Broken) -> list[Action]:
        """A rank's collective failed in world ``message.generation``: a consequence of a loss
        the coordinator is about to find (or found already); when none is found within the
        failure settle window, the run aborts with its reason."""
        if message.generation != self.generation or self.membership.losing:
            return []  # of an older world, or explained already
        reason = printable(message.reason, REASON_CHARS)
        self.watchdog.report_failure(
            now, f"rank {rank} ({self.members[rank].describe()}) failed: {reason}"
        )
        return []

    def _check_losses(self, now: float) -> list[Action] | None:
        """Losses waiting for their decision: nothing (None) or what the decision makes happen.
        While they settle, the clock's other rules (a failure's abort above all) wait."""
        if not self.membership.losing:
            return None
        if not self.membership.due(now):
            return []
        decided = self.membership.decide(Snapshots.ALL)
        self.watchdog.clear_failures()  # the peers' broken collectives followed from the loss
        if isinstance(decided, TooFew):
            return self.abort(decided.reason())
        return self._change_world(now, decided)

    # ------------------------------------------------------------------ a new world

    def _change_world(self, now: float, change: NewWorld) -> list[Action]:
        """The new world is decided: forget the lost, renumber the rest, open its store."""
        told: list[Action] = []
        for loss in change.lost:
            peer = loss.member.peer
            # a lost process that still runs (frozen, cut off) reads this first when it wakes
            why = self.membership.why_dropped(printable(loss.why, REASON_CHARS))
            told.append(Send(peer, Abort(reason=clip(why))))
            self.gate.sessions.forget(peer)  # a frame of the lost process is a stranger's now
            self.rendezvous.leave(peer)
            self.watchdog.drop(peer)
        self.generation = change.world.generation
        self.members = list(change.world.members)
        self._ranks = change.world.ranks()
        self._store = None
        self._clear_round()
        self.watchdog.new_world(now)
        self._change = change
        self._redo = self.epoch
        size = change.world.size
        actions: list[Action] = told + [
            Log(
                f"{loss.describe()} in epoch {self.epoch}: continuing with {size} worker"
                f"{'s' if size != 1 else ''} from the start of epoch {self.epoch}"
            )
            for loss in change.lost
        ]
        actions += [
            Log(
                f"{member.describe()} joins: {size} workers from epoch {self.epoch} "
                "(the state sent from rank 0 over the data plane)"
            )
            for member in change.joined
        ]
        regroup = Regroup(generation=self.generation, epoch=self.epoch)
        newcomers = {member.peer for member in change.joined}  # in rendezvous still: no regroup
        actions += [Send(m.peer, regroup) for m in self.members if m.peer not in newcomers]
        self._set_phase(RunPhase.STORE, now)
        actions.append(
            Send(self.members[0].peer, OpenStore(run_id=self.run_id, generation=self.generation))
        )
        return actions

    def _world_formed(self, now: float) -> list[Action]:
        """Every member of a new world is ready to redo its epoch: record the change."""
        change, self._change = self._change, None
        if change is None:
            return []
        seconds = round(now - change.since, 3)
        entry = {
            "epoch": self.epoch,
            "generation": self.generation,
            "from": change.previous.size,
            "to": change.world.size,
            "lost": [loss.describe() for loss in change.lost],
            "joined": [printable(m.hello.worker_id) for m in change.joined],
            "seconds": seconds,
        }
        self.world_changes.append(entry)
        if change.lost:
            formed = f"redo epoch {self.epoch} ({seconds:.1f} s after the loss)"
        else:
            formed = f"train epoch {self.epoch} ({seconds:.1f} s after the boundary)"
        return [
            Journal("epoch", {"kind": "world", **entry}),
            Log(
                f"world of generation {self.generation} formed: {change.world.size} workers "
                f"{formed}"
            ),
        ]
