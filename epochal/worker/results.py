"""What a run yields to the training code: loss sums in, epoch contexts and the learning curve out.

:class:`LossSum` is what an epoch function returns; :class:`EpochContext` what it is given;
:class:`EpochRecord` one point of the learning curve; :class:`RunResult` what
:meth:`~epochal.worker.session.Session.run_epochs` (and :func:`epochal.train`) return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epochal.worker.session import Session


@dataclass(frozen=True, slots=True)
class LossSum:
    """A loss summed over samples (``total``) and how many samples that was (``count``)."""

    total: float
    count: int


@dataclass(frozen=True, slots=True)
class EpochContext:
    """What the coordinator said about the epoch about to run; identical on every rank."""

    epoch: int
    train_batches: int
    valid_batches: int
    # 0: no validation this epoch
    lr_factor: float
    rank: int
    world_size: int
    session: Session

    def check(self) -> None:
        """Raise RunAborted if the run was aborted; call it between batches of a custom loop."""
        self.session.client.check()


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """One point of the learning curve."""

    epoch: int
    train_loss: float
    valid_loss: float | None
    smoothed_loss: float | None
    lr_factor: float
    seconds: float


@dataclass(frozen=True, slots=True)
class RunResult:
    """How the run went: the best epoch, its figures, and the whole learning curve."""

    best_epoch: int | None
    best_loss: float | None
    # smoothed monitored loss of the best epoch
    epochs_run: int
    rank: int
    world_size: int
    curve: list[EpochRecord] = field(default_factory=list)
    restore_best: bool = True
    # whether the coordinator asks for the best epoch's weights at the end
    weights_note: str | None = None
    # set when the model does not hold the weights it should (the best epoch's, when
    # restore_best): which weights it holds instead, and why

    @property
    def best(self) -> EpochRecord | None:
        """The learning-curve record of the best epoch."""
        return next((r for r in self.curve if r.epoch == self.best_epoch), None)
