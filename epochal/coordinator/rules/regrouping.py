"""How a run goes on without a lost worker: the world's changes at the coordinator.

:class:`Regrouping` is the part of :class:`~epochal.coordinator.rules.machine.RunMachine` that runs
when the run is elastic (``--min-workers`` below the world size) and a rank is lost: its process
exited (:meth:`Regrouping.process_exited`, told by the launcher), its connection closed
(:meth:`Regrouping.connection_closed`), it failed, or it went silent past the heartbeat timeout.
The losses that come together are collected for a moment (:data:`~.membership.LOSS_SETTLE`;
less, down to :data:`~.membership.LOSS_SETTLE_LEAST`, once every other rank has reported its
broken collective, a consequence, not a failure of its own), and :class:`~.membership.Membership`
decides: the survivors in their order, renumbered, as the next generation's world, or the end of
the run when fewer than ``--min-workers`` remain.

A new world forms as the first one did, under its generation: ``regroup`` to every survivor,
``open_store`` to its rank 0, and on ``store_ready`` a ``welcome`` to every member; each starts the
interrupted epoch again from the state it held at the epoch's start (``restore`` memory) and says
``epoch_ready``; the epoch's ``go`` follows. Nothing of the interrupted epoch was decided, so the
loop state stands as it was. Where the members' copies do not hold the whole state (their
``epoch_ready`` says: :class:`~epochal.protocol.SnapshotScope`), the world restores the newest
committed checkpoint instead: the loop state goes back to the end of its epoch (a copy kept when
that checkpoint was decided) and the epochs after it are decided again. A world grows at an epoch
boundary: its decision asks every member to gather its part of the state onto rank 0 (``gather``,
no ``go``) and to announce the next epoch without training it; at those readies the world grows
and rank 0 sends the state over the data plane, in every mode. Members whose training code cannot
gather (their readies say so) grow the older way (:meth:`Regrouping.grow`): at the decision,
each restoring its copy of the epoch's start, where the copies are whole; else once the checkpoint
of the epoch just decided is committed, which every member loads. Each change is
one log line, one journal record (``kind`` world) and one entry of the result's
``world_changes``. It reads and changes the run's facts in the
:class:`~.machinestate.MachineState` it is given. Pure like the machine.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

from epochal.coordinator.rules.actions import Action, Journal, Log, RunPhase, Send
from epochal.coordinator.rules.membership import NewWorld, TooFew
from epochal.protocol import (
    Abort,
    Broken,
    OpenStore,
    Regroup,
    Restore,
    clip,
)
from epochal.text import REASON_CHARS, printable

if TYPE_CHECKING:
    from epochal.coordinator.rules.machinestate import MachineState


class Regrouping:
    """The elastic part of a run's machine; see the module docstring."""

    def __init__(self, state: MachineState) -> None:
        self._state = state

    def gathers_now(self) -> bool:
        """At a decision: whether newcomers join at this boundary with the state its members
        gather onto rank 0 first (``Decision.gather``): the members write the checkpoint the
        decision may ask for, gather, and wait, so that nothing of the next epoch is begun or
        undone, and rank 0 sends the newcomers the state whatever the mode (in the sharded modes
        no rank holds it whole otherwise). Every member's last ready must say it gathers; a
        worker one minor version older, or a training loop without the hook, grows the old way
        (:meth:`grow`)."""
        return (
            self._state.config.elastic
            and self._state.phase is RunPhase.RUNNING
            and self._state.membership.grows()
            and self.members_gather()
        )

    def members_gather(self) -> bool:
        """Whether every member's last ready says it gathers the state for newcomers."""
        copies = self._state.copies
        return all(m.peer in copies and copies[m.peer].gathers for m in self._state.members)

    # ------------------------------------------------------------------ losses

    @property
    def elastic(self) -> bool:
        """Whether a lost rank's peers carry on (while at least ``--min-workers`` remain)."""
        return self._state.config.elastic and self._state.phase in (
            RunPhase.STORE,
            RunPhase.READY,
            RunPhase.RUNNING,
        )

    def lose(self, now: float, rank: int, why: str, *, hold: float = 0.0) -> bool:
        """``rank`` is lost, ``why``; True when the run goes on without it (elastic), False when
        the caller must treat it as a failure of the run. ``hold``: how long the change may wait
        for other losses that come with this one (:meth:`Membership.lose`)."""
        if not self.elastic or self._state.over:
            return False
        self._state.membership.lose(now, rank, why, hold=hold)
        return True

    def lose_silent(self, now: float) -> None:
        """Every rank silent past the heartbeat timeout that is not lost yet is lost now; its
        change waits, while another rank is unheard since, for others of the same cause (a host
        cut off), at most the heartbeat timeout (see
        :mod:`~epochal.coordinator.rules.membership`)."""
        lost = self._state.membership.lost_ranks()
        ranked = {peer: rank for peer, rank in self._state.ranks.items() if rank not in lost}
        hold = self._state.config.heartbeat_timeout
        while (silent := self._state.watchdog.first_silent(now, ranked)) is not None:
            peer, seconds = silent
            self.lose(now, ranked.pop(peer), f"sent nothing for {seconds:.1f} s", hold=hold)

    def process_exited(self, now: float, pid: int, what: str) -> bool:
        """A worker process of this machine (``pid``) exited, ``what``; True when a rank was lost
        and the run goes on without it."""
        for rank, member in enumerate(self._state.members):
            if member.hello.pid == pid:
                return self.lose(now, rank, what)
        # already lost (its connection closed first): the run goes on without it, and its exit
        # says why better than the closed connection did
        if not self._state.config.elastic or not self._state.membership.lost_pid(pid):
            return False
        self._state.membership.explain(pid, what)
        return True

    def connection_closed(self, now: float, peer: bytes) -> None:
        """A member's connection closed: in an elastic run, its rank is lost."""
        rank = self._state.ranks.get(peer)
        if rank is not None:
            self.lose(now, rank, "closed its connection to the coordinator")

    def on_broken(self, now: float, rank: int, message: Broken) -> list[Action]:
        """A rank's collective failed in world ``message.generation``: a consequence of a loss
        the coordinator is about to find (or found already); when none is found within the
        failure settle window, the run aborts with its reason."""
        if message.generation != self._state.generation:
            return []  # of an older world
        self._state.membership.broken(
            rank
        )  # alive: with every other rank so, a loss settles at once
        if self._state.membership.losing:
            return []  # explained already
        reason = printable(message.reason, REASON_CHARS)
        self._state.watchdog.report_failure(
            now, f"rank {rank} ({self._state.members[rank].describe()}) failed: {reason}"
        )
        return []

    def check_losses(self, now: float) -> list[Action] | None:
        """Losses waiting for their decision: nothing (None) or what the decision makes happen.
        While they settle, the clock's other rules (a failure's abort above all) wait."""
        if not self._state.membership.losing:
            return None
        if self.elastic:
            self.lose_silent(now)  # ranks cut off with the first lost join its change
        if not self._state.membership.due(now):
            return []
        decided = self._state.membership.decide(self._state.scope)
        # the peers' broken collectives followed from the loss
        self._state.watchdog.clear_failures()
        if isinstance(decided, TooFew):
            return self._state.abort(decided.reason())
        return self._change_world(now, decided)

    # ------------------------------------------------------------------ a new world

    def grow(
        self, now: float, checkpointed: int | None = None, *, gathered: bool = False
    ) -> list[Action] | None:
        """At an epoch boundary, newcomers waiting: the world with them (None: no change). Where
        the members' copies hold the whole state, at the decision (``checkpointed`` None): they
        keep their state and rank 0 shares it; where they ``gathered`` it onto rank 0 at the
        decision, once their readies are in: rank 0 shares that; else (members that do not
        gather: older workers) once the checkpoint of the epoch just decided is committed
        (``checkpointed``), which every member of the new world loads."""
        waits = RunPhase.READY if gathered else RunPhase.RUNNING
        if not self._state.config.elastic or self._state.phase is not waits:
            return None
        if self._state.gathering is not None:
            return None  # the members gather for the growth at their readies
        scope = self._state.scope
        from_checkpoint = scope.restore_after(()) is Restore.CHECKPOINT and not gathered
        if from_checkpoint != (checkpointed is not None):
            return None
        if checkpointed is not None and checkpointed != self._state.epoch - 1:
            return None  # an older epoch's, late: the next boundary's will do
        if checkpointed is not None and self.members_gather():
            # newcomers that came after the decision: the next decision gathers for them, so
            # that they never read the state from disk
            return None
        change = self._state.membership.at_boundary(now, scope, gathered=gathered)
        return None if change is None else self._change_world(now, change)

    def _rewind(self, checkpoint: int) -> None:
        """Back to the end of epoch ``checkpoint``: the loop state as its decision left it, the
        epochs after it to be done again."""
        self._state.loop = copy.deepcopy(self._state.loops_at[checkpoint])
        self._state.epoch = checkpoint + 1

    def _change_world(self, now: float, change: NewWorld) -> list[Action]:
        """The new world is decided: forget the lost, renumber the rest, open its store."""
        interrupted = self._state.epoch
        if change.restore is Restore.CHECKPOINT:
            usable = [e for e in self._state.committed if e in self._state.loops_at]
            if not usable:
                said = "; ".join(loss.describe() for loss in change.lost) or "newcomers joined"
                return self._state.abort(
                    f"{said} in epoch {interrupted}: the workers keep no whole copy of the "
                    f"epoch's start ({self._state.scope.value}: see docs/elastic.md) and no "
                    "checkpoint is committed yet to restore from, so the run cannot go on"
                )
            change = dataclasses.replace(change, checkpoint=max(usable))
            self._rewind(max(usable))
        told: list[Action] = []
        for loss in change.lost:
            peer = loss.member.peer
            # a lost process that still runs (frozen, cut off) reads this first when it wakes
            why = self._state.membership.why_dropped(printable(loss.why, REASON_CHARS))
            told.append(Send(peer, Abort(reason=clip(why))))
            self._state.gate.sessions.forget(
                peer
            )  # a frame of the lost process is a stranger's now
            self._state.rendezvous.leave(peer)
            self._state.watchdog.drop(peer)
        self._state.generation = change.world.generation
        self._state.members = list(change.world.members)
        self._state.ranks = change.world.ranks()
        self._state.store = None
        self._state.clear_round()
        self._state.gathering = None  # a loss while the members gathered: this world is the change
        self._state.watchdog.new_world(now)
        for peer in set(self._state.copies) - {m.peer for m in self._state.members}:
            del self._state.copies[peer]
        self._state.change = change
        size = change.world.size
        whence = f"from the start of epoch {self._state.epoch}"
        if change.checkpoint is not None:
            whence = f"from the checkpoint of epoch {change.checkpoint}"
        actions: list[Action] = told + [
            Log(
                f"{loss.describe()} in epoch {interrupted}: continuing with {size} worker"
                f"{'s' if size != 1 else ''} {whence}"
            )
            for loss in change.lost
        ]
        got = (
            f"the checkpoint of epoch {change.checkpoint}"
            if change.checkpoint is not None
            else "the state sent from rank 0 over the data plane"
        )
        actions += [
            Log(f"{member.describe()} joins: {size} workers from epoch {self._state.epoch} ({got})")
            for member in change.joined
        ]
        regroup = Regroup(generation=self._state.generation, epoch=self._state.epoch)
        newcomers = {member.peer for member in change.joined}  # in rendezvous still: no regroup
        actions += [Send(m.peer, regroup) for m in self._state.members if m.peer not in newcomers]
        self._state.set_phase(RunPhase.STORE, now)
        actions.append(
            Send(
                self._state.members[0].peer,
                OpenStore(run_id=self._state.attempt_id, generation=self._state.generation),
            )
        )
        return actions

    def world_formed(self, now: float) -> list[Action]:
        """Every member of a new world is ready to redo its epoch: record the change."""
        change, self._state.change = self._state.change, None
        if change is None:
            return []
        seconds = round(now - change.since, 3)
        entry = {
            "epoch": self._state.epoch,
            "generation": self._state.generation,
            "from": change.previous.size,
            "to": change.world.size,
            "lost": [loss.describe() for loss in change.lost],
            "joined": [printable(m.hello.worker_id) for m in change.joined],
            "seconds": seconds,
            "restore": change.restore.value,
        }
        if change.checkpoint is not None:
            entry["checkpoint"] = change.checkpoint
        self._state.world_changes.append(entry)
        if change.lost:
            formed = f"redo epoch {self._state.epoch} ({seconds:.1f} s after the loss)"
        else:
            formed = f"train epoch {self._state.epoch} ({seconds:.1f} s after the boundary)"
        return [
            Journal("epoch", {"kind": "world", **entry}),
            Log(
                f"world of generation {self._state.generation} formed: {change.world.size} workers "
                f"{formed}"
            ),
        ]
