"""How a run ends: the part of :class:`~epochal.coordinator.rules.machine.RunMachine` that commits
checkpoints (pruning the old ones) and finishes the run (the Finish to every rank, the result once
each has said done, or at ``--finish-timeout``, which the machine's clock asks it about). It reads
and changes the run's facts in the :class:`~.machinestate.MachineState` it is given. Pure like the
machine.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import TYPE_CHECKING

from epochal.coordinator.rules import ending, runstate
from epochal.coordinator.rules.actions import (
    Action,
    Broadcast,
    Finished,
    Journal,
    Log,
    Prune,
    RunPhase,
    Send,
)
from epochal.protocol import Abort

if TYPE_CHECKING:
    from epochal.coordinator.rules.machinestate import MachineState
    from epochal.coordinator.rules.regrouping import Regrouping


class Finishing:
    """The finishing part of a run's machine; see the module docstring. ``regrouping`` grows
    the world at a committed checkpoint, where newcomers wait for one."""

    def __init__(self, state: MachineState, regrouping: Regrouping) -> None:
        self._state = state
        self._regrouping = regrouping

    def on_checkpointed(self, now: float, epoch: int) -> list[Action]:
        if epoch in self._state.committed:
            return []  # sent again by a worker taken back by a restarted coordinator
        actions: list[Action] = [Journal("epoch", {"kind": "checkpoint", "epoch": epoch})]
        self._state.committed.append(epoch)
        if self._state.checkpoint_dir is not None:
            pruned = runstate.prunable(
                self._state.committed,
                self._state.config.keep_checkpoints,
                self._state.loop.best_epoch,
            )
            if pruned:
                actions.append(Prune(tuple(pruned)))
            self._state.committed = [e for e in self._state.committed if e not in pruned]
            for gone in pruned:
                self._state.loops_at.pop(gone, None)
        grown = self._regrouping.grow(now, checkpointed=epoch)  # a world whose copies are not whole
        return actions + (grown or [])

    def closed_early(self, now: float, rank: int) -> list[Action]:
        """A rank closed its session before it announced any epoch (a script with a loop of its
        own): the run finishes; every rank gets the Finish now, and the run ends when each has
        closed (or at ``--finish-timeout``). A rank that still asks for an epoch is out of step."""
        actions = [
            Log(
                f"rank {rank} ({self._state.members[rank].describe()}) closed its session without "
                "running epochs: its script keeps its own loop (epochal.join() for the process "
                "group only, or a torchrun script); the run finishes once every rank has closed "
                "its session"
            ),
            *self.finish(now, decided=False),
        ]
        self._state.ready.clear()
        return actions + self.done_by(rank)

    def done_by(self, rank: int) -> list[Action]:
        """``rank`` has finished (said done); the run ends once every rank has."""
        self._state.done.add(rank)
        return self.end() if len(self._state.done) == len(self._state.members) else []

    def finish(self, now: float, *, decided: bool = True) -> list[Action]:
        """The Finish to every rank; ``decided``: after the run's last epoch was decided (not a
        script with a loop of its own, whose other ranks may still be training)."""
        finish, line = ending.finish(self._state.loop, self._state.config, self._state.run_id)
        self._state.set_phase(RunPhase.FINISHING, now)
        self._state.finish_decided = decided
        late = Abort(reason="the run finished before this worker could join it")
        waiting = [Send(peer, late) for peer in self._state.membership.standby]
        return [Broadcast(self._state.recipients(), finish), Log(line), *waiting]

    def end(self) -> list[Action]:
        summary, result = ending.result(self._state.loop, self._state.run_id)
        if self._state.config.elastic:
            result["world_changes"] = self._state.world_changes
        self._state.over = True
        return [Journal("result", result), Finished(summary)]

    def check_finishing(self, now: float, waited: float) -> list[Action]:
        """The Finish is out; the ranks that said done are waited for no more. After the last
        epoch's decision the run's result stands whether or not each rank confirms it: a rank
        silent past the heartbeat timeout is not waited for (its Done can be lost with its
        connection as its process ends: a frame lost on the way, then the socket closed), and
        none past ``--finish-timeout``. Where no epoch was decided (ranks with loops of their own,
        still training when one closed its session), a silent rank aborts the run as in any
        other phase. A failure a rank reports aborts either way (the clock's rules before this)."""
        cfg = self._state.config
        silent = self._state.watchdog.first_silent(
            now, _Pending(self._state.ranks, self._state.done)
        )
        if silent is not None:
            peer, seconds = silent
            rank = self._state.ranks[peer]
            if not self._state.finish_decided:
                return self._state.abort(
                    self._state.watchdog.silence(rank, seconds, self._state.members)
                )
            line = (
                f"rank {rank} ({self._state.members[rank].describe()}) has not confirmed the "
                f"finish and sent nothing for {seconds:.1f} s (its process may have ended before "
                "its last message arrived): every epoch is decided, so the result stands"
            )
            return [Log(line), *self.done_by(rank)]
        if waited > cfg.finish_timeout:
            missing = sorted(set(range(len(self._state.members))) - self._state.done)
            line = f"ranks {missing} did not confirm the finish within {cfg.finish_timeout:g} s"
            return [Log(line), *self.end()]
        return []


class _Pending:
    """The ranked peers that have not said done (a view: nothing copied per tick)."""

    __slots__ = ("_done", "_ranks")

    def __init__(self, ranks: Mapping[bytes, int], done: Container[int]) -> None:
        self._ranks, self._done = ranks, done

    def __contains__(self, peer: object) -> bool:
        rank = self._ranks.get(peer) if isinstance(peer, bytes) else None
        return rank is not None and rank not in self._done
