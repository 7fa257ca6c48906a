"""A session's checkpoints: the one a run resumes from, each epoch's save, the one a new world
restores, a checkpoint loaded on request and the best epoch's at the end.

:class:`Savepoints` reads the checkpointer and the resume epoch from the session's
:class:`~epochal.worker.sessionparts.standing.Standing`; it writes and reads files, and hands each
commit of rank 0's to ``committed`` (the exchange's
:meth:`~epochal.worker.sessionparts.exchange.Exchange.committed`, which tells the coordinator and
says it again to a restarted one).

A state whole on rank 0 (:func:`~epochal.worker.checkpoints.state.whole_on_root`: replicated,
main) is saved in the background: rank 0's checkpoint is written while the next epoch trains, and
its commit is handed on from the writer's thread as soon as the rename is durable, so that a
failure after the write resumes from it as after a synchronous save; a failure before resumes from
the previous committed checkpoint. :meth:`Savepoints.settle`, which the session calls at the next
boundary, before a new world, a resume and the run's end, joins the writer and raises its error;
every save and load settles first, so two are never in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace

from epochal.errors import EpochalError
from epochal.log import WORKER
from epochal.worker.checkpoints.asyncsave import BackgroundSave
from epochal.worker.checkpoints.checkpoint import CheckpointCorrupt
from epochal.worker.checkpoints.state import Stateful, whole_on_root
from epochal.worker.sessionparts.standing import Standing
from epochal.worker.training.results import EpochRecord, RunResult


class Savepoints:
    """A session's checkpoints; see the module docstring."""

    def __init__(self, standing: Standing, committed: Callable[[int], None]) -> None:
        self._standing = standing
        self._committed = committed
        self._pending: BackgroundSave | None = None  # rank 0's checkpoint being written

    def settle(self) -> None:
        """Wait for the checkpoint being written, if any (its writer handed its commit on
        already); the writer's error, raised here once, fails the run as a synchronous save's
        would."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def drain(self) -> None:
        """Wait for the checkpoint being written, if any, nothing handed on: the run is failing
        for another reason, which is the one it reports."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.drain()

    def resume(self, state: Stateful | None) -> list[EpochRecord]:
        """Load the checkpoint the coordinator resumes from; the learning curve up to it."""
        self.settle()
        resume_epoch = self._standing.resume_epoch
        checkpointer = self._standing.checkpointer
        if resume_epoch is None:
            return []
        if state is None or checkpointer is None:
            raise EpochalError(
                f"the coordinator resumes this run after epoch {resume_epoch}, but there is "
                "no state to load it into: pass state= to run_epochs (or use epochal.train)"
            )
        # a rank the checkpoint's world had not (a newcomer to a world that restores it, or a
        # resume at a larger size than the last checkpoint's) keeps its own generators
        history = checkpointer.load(resume_epoch, state, rng=None)
        if not isinstance(history, list):  # a checkpoint written before curves were kept
            return []
        return [
            EpochRecord(**r) for r in history if isinstance(r, dict) and r["epoch"] <= resume_epoch
        ]

    def save(self, epoch: int, state: Stateful, curve: list[EpochRecord]) -> None:
        """Collective: save ``epoch``'s checkpoint with the learning curve up to it. Rank 0's
        commit is handed on once the rename is durable: now, or, for a state whole on rank 0,
        from the thread that writes it while the next epoch trains."""
        self.settle()
        checkpointer = self._standing.checkpointer
        if checkpointer is None:
            return
        history = [asdict(r) for r in curve]
        if whole_on_root(state):
            self._pending = checkpointer.save_behind(
                epoch, state, history=history, then=self._committed
            )
        elif checkpointer.save(epoch, state, history=history) is not None:
            self._committed(epoch)

    def load_for_world(self, epoch: int, state: Stateful | None) -> None:
        """Collective: every member of the new world loads the checkpoint of ``epoch``, which DCP
        reshards to the new size, and this rank's generators where the checkpoint has them."""
        self.settle()
        checkpointer = self._standing.checkpointer
        if state is None or checkpointer is None:
            raise EpochalError(
                f"the new world restores the checkpoint of epoch {epoch}, but this training loop "
                "returned no state to load it into from its rebuild (or the run has no "
                "checkpoint directory)"
            )
        checkpointer.load(epoch, state, rng=None)

    def load(self, epoch: int, state: Stateful) -> None:
        """Collective: load ``epoch``'s committed checkpoint into ``state`` (RNGs untouched).

        Raises :class:`~epochal.worker.checkpoints.checkpoint.CheckpointCorrupt` (nothing loaded)
        when the checkpoint does not match its manifest.
        """
        self.settle()
        checkpointer = self._standing.checkpointer
        if checkpointer is None:
            raise EpochalError("this run has no checkpoint directory")
        checkpointer.load(epoch, state, rng=False)

    def restore_best(self, result: RunResult, state: Stateful) -> RunResult:
        """Collective: load the best epoch's checkpoint into ``state`` at the end of the run.

        A damaged checkpoint is never loaded: ``state`` keeps the last epoch's weights, and the
        returned result says so in ``weights_note`` (also printed), rather than claiming the best.
        """
        if result.best_epoch is None:
            return result
        try:
            self.load(result.best_epoch, state)
        except CheckpointCorrupt as exc:
            last = max((r.epoch for r in result.curve), default=None)
            note = (
                f"{exc}; the model keeps the weights of the last epoch trained ({last}) instead "
                f"of the best epoch's ({result.best_epoch})"
            )
            WORKER.info(f"epochal: rank {self._standing.rank}: {note}")
            return replace(result, weights_note=note)
        return result
