"""Checkpoints in a session: the one a run resumes from, each epoch's commit (rank 0 says it to
the coordinator), a checkpoint loaded on request and the best epoch's at the end.

:class:`Checkpointing` is the part of :class:`~epochal.worker.session.Session` that does it; the
session sets every attribute below in its ``__init__`` (and ``_adopt``).
"""

from __future__ import annotations

from dataclasses import asdict, replace

from epochal.errors import EpochalError
from epochal.log import WORKER
from epochal.protocol import Checkpointed
from epochal.worker.checkpoints.checkpoint import CheckpointCorrupt, Checkpointer
from epochal.worker.checkpoints.state import Stateful
from epochal.worker.control.client import ControlClient
from epochal.worker.training.results import EpochRecord, RunResult


class Checkpointing:
    """A session's checkpoints; see the module docstring."""

    client: ControlClient
    rank: int
    resume_epoch: int | None
    checkpointer: Checkpointer | None
    _saved: int | None

    def _resume(self, state: Stateful | None) -> list[EpochRecord]:
        """Load the checkpoint the coordinator resumes from; the learning curve up to it."""
        if self.resume_epoch is None:
            return []
        if state is None or self.checkpointer is None:
            raise EpochalError(
                f"the coordinator resumes this run after epoch {self.resume_epoch}, but there is "
                "no state to load it into: pass state= to run_epochs (or use epochal.train)"
            )
        # a rank the checkpoint's world had not (a newcomer to a world that restores it, or a
        # resume at a larger size than the last checkpoint's) keeps its own generators
        history = self.checkpointer.load(self.resume_epoch, state, rng=None)
        if not isinstance(history, list):  # a checkpoint written before curves were kept
            return []
        return [
            EpochRecord(**r)
            for r in history
            if isinstance(r, dict) and r["epoch"] <= self.resume_epoch
        ]

    def _save(self, epoch: int, state: Stateful, curve: list[EpochRecord]) -> None:
        if self.checkpointer is None:
            return
        history = [asdict(r) for r in curve]
        if self.checkpointer.save(epoch, state, history=history) is not None:
            self.client.send(Checkpointed(epoch=epoch))  # rank 0, once the rename is durable
            self._saved = epoch

    def load_checkpoint(self, epoch: int, state: Stateful) -> None:
        """Collective: load ``epoch``'s committed checkpoint into ``state`` (RNGs untouched).

        Raises :class:`~epochal.worker.checkpoints.checkpoint.CheckpointCorrupt` (nothing loaded)
        when the checkpoint does not match its manifest.
        """
        if self.checkpointer is None:
            raise EpochalError("this run has no checkpoint directory")
        self.checkpointer.load(epoch, state, rng=False)

    def restore_best(self, result: RunResult, state: Stateful) -> RunResult:
        """Collective: load the best epoch's checkpoint into ``state`` at the end of the run.

        A damaged checkpoint is never loaded: ``state`` keeps the last epoch's weights, and the
        returned result says so in ``weights_note`` (also printed), rather than claiming the best.
        """
        if result.best_epoch is None:
            return result
        try:
            self.load_checkpoint(result.best_epoch, state)
        except CheckpointCorrupt as exc:
            last = max((r.epoch for r in result.curve), default=None)
            note = (
                f"{exc}; the model keeps the weights of the last epoch trained ({last}) instead "
                f"of the best epoch's ({result.best_epoch})"
            )
            WORKER.info(f"epochal: rank {self.rank}: {note}")
            return replace(result, weights_note=note)
        return result
