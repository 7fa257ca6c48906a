"""lamp's epoch loop state, decided by the coordinator: smoothing, the best epoch, the learning
rate and when to stop.

:class:`LoopState` takes each epoch's global losses and metrics and returns its
:class:`~epochal.coordinator.rules.outcome.EpochOutcome`; a resume rebuilds it exactly by replaying
the
journal's records. Pure (``tests/coordinator/test_loop_rules.py``, ``test_policy.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from epochal.cli.suggest import close_matches
from epochal.coordinator.config import CoordinatorConfig, MonitorMode
from epochal.coordinator.rules.batches import PolicyViolation
from epochal.coordinator.rules.outcome import EpochOutcome
from epochal.coordinator.rules.schedule import Schedule
from epochal.protocol import StepRates

_DECLARED: dict[str, Any] = {
    name: f.default for name, f in CoordinatorConfig.__dataclass_fields__.items()
}
"""The defaults :class:`CoordinatorConfig` declares, by field: the loop's rules have no defaults
of their own."""


_SAME_NAMES = ("smoothing", "patience", "min_delta", "best_from", "monitor")
"""The loop's rules that are the configuration's fields of the same name."""


def monitored_key(monitor: str, validates: bool) -> str:
    """The journal key of the monitored value: ``valid_NAME`` when the run validates, else
    ``train_NAME`` (``loss`` is ``valid_loss`` / ``train_loss``)."""
    return f"{'valid' if validates else 'train'}_{monitor}"


def missing_monitor(monitor: str, names: list[str], what: str = "") -> str:
    """Why ``--monitor monitor`` cannot be followed: the workers report only ``names`` (besides
    the loss) of the ``what`` split ("validation ", "training ", "" before the first epoch); the
    likeliest name they meant, else what to do."""
    close = close_matches(monitor, names, n=1)
    fix = (
        f"did you mean --monitor {close[0]}? Else add" if close else "monitor one of those, or add"
    )
    return (
        f"--monitor {monitor}: the workers report no {what}metric of that name (they report "
        f"{', '.join(['loss', *names])}): {fix} {monitor!r} to the training code's metrics"
    )


@dataclass(slots=True)
class LoopState:
    """lamp's epoch loop state: smoothed monitored value, best epoch, learning-rate factor, stop.

    The monitored value is ``monitor`` (``"loss"``, or the name of a metric the training code
    reports) of the validation split when the run validates, else of the training split; ``mode``
    says whether lower (``"min"``) or higher (``"max"``) is better. Smoothing is lamp's
    ``s = a*raw + (1-a)*s_prev``, seeded with the first value; epochs without a monitored value
    leave the state as it is (lamp resets it; we keep it). The best epoch is the one with the
    strictly best smoothed value (ties keep the earlier epoch) among epochs >= ``best_from``. The
    run stops after the last epoch, when the schedule's next factor is <= 0, or when more than
    ``patience`` monitored epochs in a row failed to improve the best smoothed value by more than
    ``min_delta``. The plateau schedule sees the smoothed value, negated under ``max``.

    ``smoothed`` and ``best_loss`` (and an outcome's ``smoothed_loss`` / ``best_loss``) hold the
    monitored value, whatever it is. Everything here is a function of the sequence of
    :meth:`update` calls, so replaying a run's journal rebuilds the state exactly.
    """

    epochs: int
    smoothing: float = _DECLARED["smoothing"]
    schedule: Schedule | None = None
    patience: int | None = _DECLARED["patience"]
    min_delta: float = _DECLARED["min_delta"]
    best_from: int = _DECLARED["best_from"]
    monitor: str = _DECLARED["monitor"]
    mode: MonitorMode = _DECLARED["monitor_mode"]
    smoothed: float | None = None
    best_epoch: int | None = None
    best_loss: float | None = None
    lr_factor: float = 1.0
    schedule_state: dict[str, Any] = field(default_factory=dict)
    stale: int = 0
    # monitored epochs since the last improvement (for patience)
    history: list[EpochOutcome] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: CoordinatorConfig) -> LoopState:
        """A fresh loop under the run's settings."""
        same = {name: getattr(config, name) for name in _SAME_NAMES}
        schedule = config.schedule
        return cls(
            epochs=config.epochs,
            schedule=schedule,
            mode=config.monitor_mode,
            lr_factor=schedule.first_factor(),
            **same,
        )

    def schedule_rates(self) -> StepRates | None:
        """What each welcome sends of a per-step schedule (None: the factor is per epoch)."""
        return None if self.schedule is None else self.schedule.step_rates()

    def observed(
        self,
        train_loss: float,
        valid_loss: float | None,
        metrics: Mapping[str, float],
        *,
        validates: bool,
    ) -> float | None:
        """This epoch's monitored value; None when the epoch did not validate in a run that does.

        Raises PolicyViolation when the monitored metric is not among those reported, naming
        the ones that are.
        """
        if self.monitor == "loss":
            return valid_loss if validates else train_loss
        if validates and valid_loss is None:
            return None
        key = monitored_key(self.monitor, validates)
        if key in metrics:
            return metrics[key]
        split = "valid" if validates else "train"
        names = [k[len(split) + 1 :] for k in sorted(metrics) if k.startswith(f"{split}_")]
        what = "validation " if validates else "training "
        raise PolicyViolation(missing_monitor(self.monitor, names, what))

    def _better(self, value: float, than: float, margin: float = 0.0) -> bool:
        if self.mode == "max":
            return value > than + margin
        return value < than - margin

    def update(
        self,
        epoch: int,
        train_loss: float,
        valid_loss: float | None,
        *,
        validates: bool,
        metrics: Mapping[str, float] | None = None,
        lr: float | None = None,
    ) -> EpochOutcome:
        """Record ``epoch``'s global losses and metrics (by journal key) and return the decision
        for it; PolicyViolation (nothing changed) when the monitored metric is not reported.
        ``lr``: the learning rate the workers said their optimizer held (None: not said)."""
        metrics = dict(metrics or {})
        observed = self.observed(train_loss, valid_loss, metrics, validates=validates)
        is_best = False
        if observed is not None:
            a = self.smoothing
            previous_best = self.best_loss
            if self.smoothed is None:
                self.smoothed = observed
            else:
                self.smoothed = a * observed + (1 - a) * self.smoothed
            if epoch >= self.best_from and (
                self.best_loss is None or self._better(self.smoothed, self.best_loss)
            ):
                self.best_epoch, self.best_loss, is_best = epoch, self.smoothed, True
            improved = previous_best is None or self._better(
                self.smoothed, previous_best, self.min_delta
            )
            self.stale = 0 if improved else self.stale + 1
        factor = self.lr_factor
        if self.schedule is not None:
            seen = None
            if observed is not None and self.smoothed is not None:
                seen = -self.smoothed if self.mode == "max" else self.smoothed
            self.lr_factor = self.schedule.next_factor(epoch, seen, factor, self.schedule_state)
        stop_reason = None
        if epoch + 1 >= self.epochs:
            stop_reason = "epochs"
        elif self.lr_factor <= 0:
            stop_reason = "lr_factor"
        elif self.patience is not None and observed is not None and self.stale > self.patience:
            stop_reason = "patience"
        outcome = EpochOutcome(
            epoch=epoch,
            train_loss=train_loss,
            valid_loss=valid_loss,
            smoothed_loss=self.smoothed if observed is not None else None,
            best_epoch=self.best_epoch,
            best_loss=self.best_loss,
            is_best=is_best,
            stop=stop_reason is not None,
            lr_factor=factor,
            next_lr_factor=self.lr_factor,
            stop_reason=stop_reason,
            metrics=metrics,
            lr=lr,
        )
        self.history.append(outcome)
        return outcome
