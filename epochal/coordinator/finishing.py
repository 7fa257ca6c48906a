"""How a run ends, and what the clock finds between messages: the part of
:class:`~epochal.coordinator.machine.RunMachine` that commits checkpoints (pruning the old ones),
finishes the run (the Finish to every rank, the result once each has said done, or at
``--finish-timeout``) and, on every tick, asks the watchdog and the phases' own checks whether a
rank is lost, a phase overran or a newcomer went silent. Pure like the machine.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from epochal.coordinator import ending, runstate
from epochal.coordinator.actions import (
    Action,
    Broadcast,
    Finished,
    Journal,
    Log,
    Prune,
    RunPhase,
    Send,
)
from epochal.coordinator.batches import BatchCounts
from epochal.coordinator.sums import LossSums
from epochal.coordinator.takeback import TakingBack
from epochal.protocol import Abort


class Finishing(TakingBack):
    """The finishing and clock side of a run's machine; see the module docstring. The machine
    sets every attribute below in its ``__init__``."""

    _done: set[int]
    _finish_decided: bool
    _ready: dict[int, BatchCounts]
    _reports: dict[int, LossSums]

    def _recipients(self) -> tuple[bytes, ...]:
        raise NotImplementedError  # the machine's

    def _on_checkpointed(self, now: float, epoch: int) -> list[Action]:
        if epoch in self._committed:
            return []  # sent again by a worker taken back by a restarted coordinator
        actions: list[Action] = [Journal("epoch", {"kind": "checkpoint", "epoch": epoch})]
        self._committed.append(epoch)
        if self._checkpoint_dir is not None:
            pruned = runstate.prunable(
                self._committed, self.config.keep_checkpoints, self._loop.best_epoch
            )
            if pruned:
                actions.append(Prune(tuple(pruned)))
            self._committed = [e for e in self._committed if e not in pruned]
            for gone in pruned:
                self._loops_at.pop(gone, None)
        grown = self._grow(now, checkpointed=epoch)  # a world whose copies are not whole
        return actions + (grown or [])

    def _closed_early(self, now: float, rank: int) -> list[Action]:
        """A rank closed its session before it announced any epoch (a script with a loop of its
        own): the run finishes; every rank gets the Finish now, and the run ends when each has
        closed (or at ``--finish-timeout``). A rank that still asks for an epoch is out of step."""
        actions = [
            Log(
                f"rank {rank} ({self.members[rank].describe()}) closed its session without "
                "running epochs: its script keeps its own loop (epochal.join() for the process "
                "group only, or a torchrun script); the run finishes once every rank has closed "
                "its session"
            ),
            *self._finish(now, decided=False),
        ]
        self._ready.clear()
        return actions + self._done_by(rank)

    def _done_by(self, rank: int) -> list[Action]:
        """``rank`` has finished (said done); the run ends once every rank has."""
        self._done.add(rank)
        return self._end() if len(self._done) == len(self.members) else []

    def _finish(self, now: float, *, decided: bool = True) -> list[Action]:
        """The Finish to every rank; ``decided``: after the run's last epoch was decided (not a
        script with a loop of its own, whose other ranks may still be training)."""
        finish, line = ending.finish(self._loop, self.config, self.run_id)
        self._set_phase(RunPhase.FINISHING, now)
        self._finish_decided = decided
        late = Abort(reason="the run finished before this worker could join it")
        waiting = [Send(peer, late) for peer in self.membership.standby]
        return [Broadcast(self._recipients(), finish), Log(line), *waiting]

    def _end(self) -> list[Action]:
        summary, result = ending.result(self._loop, self.run_id)
        if self.config.elastic:
            result["world_changes"] = self.world_changes
        self.over = True
        return [Journal("result", result), Finished(summary)]

    # ------------------------------------------------------------------ the clock

    def _check_clock(self, now: float) -> list[Action]:
        dog = self.watchdog
        losses = self._check_losses(now)
        if losses is not None:
            return losses
        quiet = dog.first_silent(now, self.membership.standby)
        if quiet is not None:  # a standby newcomer that went silent is forgotten
            peer = quiet[0]
            member = self.membership.leave(peer)
            assert member is not None
            self.rendezvous.leave(peer)
            self.gate.sessions.forget(peer)
            dog.drop(peer)
            return [Log(f"{member.describe()} went silent while waiting to join; forgotten")]
        if self.elastic:
            self._lose_silent(now)
            if self.membership.losing:
                return []
        failed = dog.failure_due(now)
        if failed is not None:
            return self.abort(failed)
        expired = self.models.expired(now)
        if expired is not None:
            return self._checked(now, expired)
        if self._store is not None and self.phase is RunPhase.STORE:
            return []  # the store is open; the welcome waits for rank 0's list, a bounded while
        waited = now - dog.phase_started
        if self.taking_back:
            return self._check_taking_back(now, waited)
        if self._carry is not None and not self.rendezvous.members:
            return self._check_first_back(waited)
        if self.phase is RunPhase.RENDEZVOUS:
            return self._check_rendezvous(now, waited)
        if self.phase is RunPhase.FINISHING:
            return self._check_finishing(now, waited)
        answered = self._ready if self.phase is RunPhase.READY else self._reports
        lines, reason = dog.check(
            now,
            phase=self.phase,
            epoch=self.epoch,
            answered=answered,
            members=self.members,
            ranks=self._ranks,
            welcomed=self._store is not None,
        )
        actions: list[Action] = [Log(line) for line in lines]
        if reason is not None:
            return actions + self.abort(reason)
        return actions

    def _check_finishing(self, now: float, waited: float) -> list[Action]:
        """The Finish is out; the ranks that said done are waited for no more. After the last
        epoch's decision the run's result stands whether or not each rank confirms it: a rank
        silent past the heartbeat timeout is not waited for (its Done can be lost with its
        connection as its process ends: a frame lost on the way, then the socket closed), and
        none past ``--finish-timeout``. Where no epoch was decided (ranks with loops of their own,
        still training when one closed its session), a silent rank aborts the run as in any
        other phase. A failure a rank reports aborts either way (the clock's rules before this)."""
        cfg = self.config
        silent = self.watchdog.first_silent(now, _Pending(self._ranks, self._done))
        if silent is not None:
            peer, seconds = silent
            rank = self._ranks[peer]
            if not self._finish_decided:
                return self.abort(self.watchdog.silence(rank, seconds, self.members))
            line = (
                f"rank {rank} ({self.members[rank].describe()}) has not confirmed the finish and "
                f"sent nothing for {seconds:.1f} s (its process may have ended before its last "
                "message arrived): every epoch is decided, so the result stands"
            )
            return [Log(line), *self._done_by(rank)]
        if waited > cfg.finish_timeout:
            missing = sorted(set(range(len(self.members))) - self._done)
            line = f"ranks {missing} did not confirm the finish within {cfg.finish_timeout:g} s"
            return [Log(line), *self._end()]
        return []


class _Pending:
    """The ranked peers that have not said done (a view: nothing copied per tick)."""

    __slots__ = ("_done", "_ranks")

    def __init__(self, ranks: Mapping[bytes, int], done: Container[int]) -> None:
        self._ranks, self._done = ranks, done

    def __contains__(self, peer: object) -> bool:
        rank = self._ranks.get(peer) if isinstance(peer, bytes) else None
        return rank is not None and rank not in self._done
