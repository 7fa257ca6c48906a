"""What a run yields to the training code: loss sums in, epoch contexts and the learning curve out.

:class:`LossSum` is what an epoch function returns; :class:`EpochContext` what it is given;
:class:`EpochRecord` one point of the learning curve; :class:`RunResult` what
:meth:`~epochal.worker.session.Session.run_epochs` (and :func:`epochal.train`) return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epochal.protocol import MAX_METRICS, Decision, Metric

if TYPE_CHECKING:
    from epochal.worker.session import Session


@dataclass(frozen=True, slots=True)
class LossSum:
    """A loss summed over samples (``total``) and how many samples that was (``count``).

    ``metrics`` holds further named metrics the same way, ``name -> (sum over samples, sample
    count)``: ``{"accuracy": (correct, n)}``. The coordinator sums them over the ranks and divides
    (so each rank weighs by its samples), journals them and can monitor one (``--monitor``). A name
    is 1-64 letters, digits or ``_``, starting with a letter, and neither ``loss`` nor ``batches``.
    """

    total: float
    count: int
    metrics: Mapping[str, tuple[float, int]] = field(default_factory=dict)


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
    steps_per_epoch: int | None = None
    # the run's --steps-per-epoch; None: an epoch is one pass
    batches_done: int = 0
    # global batches the run consumed before this epoch, every rank one batch of each (every
    # epoch runs train_batches of them): where a loader of epochal.batches starts the epoch
    data_pass: int | None = None
    # the pass the epoch starts in; None: not known (run_epochs was given no passes=)
    pass_batch: int | None = None
    # global batches of data_pass consumed before this epoch; None: not known

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
    # the smoothed monitored value (the loss unless the coordinator monitors a metric)
    lr_factor: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    # every metric's value over all ranks by split and name: {"valid_accuracy": 0.96, ...}


@dataclass(frozen=True, slots=True)
class RunResult:
    """How the run went: the best epoch, its figures, and the whole learning curve."""

    best_epoch: int | None
    best_loss: float | None
    # smoothed monitored value of the best epoch (the loss unless a metric is monitored)
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


def wire_metrics(split: str, sums: LossSum) -> tuple[Metric, ...]:
    """An epoch function's named metrics as they travel; ValueError naming a bad one."""
    metrics = getattr(sums, "metrics", None) or {}
    out = []
    for name, pair in sorted(metrics.items()):
        try:
            total, count = pair
            out.append(Metric(name=name, total=float(total), count=int(count)))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"the {split} function's metric {name!r} = {pair!r} is not a (sum, count) pair "
                f"of a metric epochal can carry: {exc}"
            ) from None
    if len(out) > MAX_METRICS:
        raise ValueError(f"the {split} function reports {len(out)} metrics, over {MAX_METRICS}")
    return tuple(out)


def metric_values(decision: Decision) -> dict[str, float]:
    """The metrics of a Decision as values by journal key (``valid_accuracy``)."""
    return {
        f"{split}_{m.name}": m.total / m.count
        for split, metrics in (("train", decision.train_metrics), ("valid", decision.valid_metrics))
        for m in metrics
        if m.count > 0
    }
