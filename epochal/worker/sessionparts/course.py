"""The course of a session's epoch loop: what the training code gave
:meth:`~epochal.worker.session.Session.run_epochs` (:class:`Training`) and where the loop is
(:class:`Course`), so that each step of the loop takes these two rather than a long argument list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epochal.protocol import Decision, EpochReady, Go, SnapshotScope
from epochal.worker.checkpoints.state import Stateful
from epochal.worker.control.worlds import Rejoin
from epochal.worker.training.results import EpochContext, EpochRecord, LossSum

if TYPE_CHECKING:
    from epochal.worker.session import Session

Batches = tuple[int, int | None] | Callable[[int], tuple[int, int | None]]
"""A rank's (train, validation) batch counts, or a function of the epoch returning them."""
PassShape = Callable[[], tuple[int | None, int | None]]
"""The (global batches of a pass, samples of a global batch) of a rank's training data."""


@dataclass(frozen=True, slots=True)
class Training:
    """What the training code gave :meth:`Session.run_epochs` (see there)."""

    train_epoch: Callable[[EpochContext], LossSum]
    valid_epoch: Callable[[EpochContext], LossSum] | None
    batches: Batches
    on_best: Callable[[int], None] | None
    rejoin: Rejoin | None
    passes: PassShape | None = None

    def ready(self, epoch: int, generation: int) -> EpochReady:
        """This rank's batch counts for ``epoch`` in world ``generation`` (valid None: it has no
        validation function), what its copy of the epoch's start holds and whether it gathers
        its state for newcomers (``rejoin``: how its training loop follows a change of world)."""
        batches, rejoin = self.batches, self.rejoin
        train_batches, valid_batches = batches(epoch) if callable(batches) else batches
        pass_batches, global_batch = (None, None) if self.passes is None else self.passes()
        return EpochReady(
            epoch,
            train_batches,
            None if self.valid_epoch is None else valid_batches,
            generation,
            snapshots=(SnapshotScope.WHOLE if rejoin is None else rejoin.scope).value,
            gathers=rejoin is not None and rejoin.gather is not None,
            pass_batches=pass_batches,
            global_batch=global_batch,
        )

    def context(self, go: Go, session: Session) -> EpochContext:
        """What the training code is given for the epoch ``go`` starts: the Go's counts, this
        rank's place, and where the run's data stands at the epoch's start. Every epoch runs
        ``go.train_batches`` global batches, so ``epoch`` epochs consumed that many times
        ``epoch``; an epoch of one pass starts its pass at batch 0."""
        steps, done = session.steps_per_epoch, go.epoch * go.train_batches
        data_pass: int | None = go.epoch
        pass_batch: int | None = 0
        if steps is not None:
            pass_batches = None if self.passes is None else self.passes()[0]
            data_pass, pass_batch = (None, None) if not pass_batches else divmod(done, pass_batches)
        return EpochContext(
            epoch=go.epoch,
            train_batches=go.train_batches,
            valid_batches=go.valid_batches,
            lr_factor=go.lr_factor,
            rank=session.rank,
            world_size=session.world_size,
            session=session,
            steps_per_epoch=steps,
            batches_done=done,
            data_pass=data_pass,
            pass_batch=pass_batch,
        )


@dataclass(slots=True)
class Course:
    """Where the epoch loop is: the epoch next (or, once stopped, the one after the last), the
    Go the last decision carried (None: announce the epoch), the curve so far and the state a
    checkpoint holds."""

    epoch: int
    state: Stateful | None
    curve: list[EpochRecord] = field(default_factory=list)
    go: Go | None = None
    stopped: bool = False

    def advance(self, decision: Decision) -> None:
        """The epoch is decided: on to the next, with the Go the decision carried."""
        self.stopped, self.go = decision.stop, decision.go
        self.epoch += 1

    def restart(self, epoch: int) -> None:
        """Run again from ``epoch`` (a resume, a new world), announced; the curve up to it."""
        self.epoch, self.stopped, self.go = epoch, False, None
        self.curve = [r for r in self.curve if r.epoch < epoch]
