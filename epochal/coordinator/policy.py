"""The per-epoch decisions, as pure functions and one small state class.

Nothing here does I/O or reads a clock: the service passes the inputs in and sends what comes out,
so every rule is tested with plain tables (``tests/coordinator/test_policy.py``).

- :func:`plan_epoch` checks every rank's batch counts before any collective runs;
- :func:`aggregate` turns per-rank loss sums into sample-weighted global losses, and
  :func:`aggregate_metrics` does the same for the training code's named metrics;
- :class:`LoopState` smooths the monitored value (the loss, or a metric with ``--monitor``), tracks
  the best epoch and decides when to stop.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from epochal.coordinator.config import BatchPolicy, CoordinatorConfig, MonitorMode
from epochal.coordinator.schedule import Schedule
from epochal.protocol import Decision, Go
from epochal.protocol.messages import Metric

MetricSums = dict[str, tuple[float, int]]
"""Named metrics of one split as ``name -> (sum over samples, sample count)``."""

WIRE_INT_MAX = 2**64 - 1
"""The largest integer a message carries (msgpack's unsigned 64 bits). Every count the coordinator
adds up is checked against it: each rank's count fits, but their sum may not, and a sum that
cannot be sent would crash the encoder of the decision instead of aborting the run."""

SPLITS = ("train", "valid")


class PolicyViolation(Exception):
    """The inputs break a rule; the message says which rank, what, and how to fix it."""


@dataclass(frozen=True, slots=True)
class BatchCounts:
    """What one rank announced for an epoch (``valid`` None: no validation loader)."""

    train: int
    valid: int | None


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """How many batches every rank runs this epoch (``valid_batches`` 0: no validation)."""

    train_batches: int
    valid_batches: int


@dataclass(frozen=True, slots=True)
class LossSums:
    """One rank's reported loss sums for an epoch."""

    train_sum: float
    train_count: int
    valid_sum: float
    valid_count: int
    train_metrics: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    valid_metrics: Mapping[str, tuple[float, int]] = field(default_factory=dict)

    def metrics(self, split: str) -> Mapping[str, tuple[float, int]]:
        return self.train_metrics if split == "train" else self.valid_metrics


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2,5"``; one rank -> ``"rank 3"``.

    Keeps messages about 1,000 ranks short.
    """
    ordered = sorted(ranks)
    spans: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("ranks " if len(ordered) > 1 else "rank ") + ",".join(spans)


def _by_count(counts: Mapping[int, int | None]) -> str:
    groups: dict[int | None, list[int]] = defaultdict(list)
    for rank, n in counts.items():
        groups[n].append(rank)
    # the minority first: that is the rank the user most likely needs to look at
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), min(kv[1])))
    parts = []
    for n, ranks in ordered:
        verb = "has" if len(ranks) == 1 else "have"
        parts.append(f"{format_ranks(ranks)} {verb} {'no' if n is None else n}")
    return ", ".join(parts)


def plan_epoch(counts: Mapping[int, BatchCounts], policy: BatchPolicy) -> EpochPlan:
    """Check every rank's batch counts and return what all ranks run, or raise PolicyViolation.

    An empty train loader is refused under every policy (it would leave the other ranks waiting in a
    collective); so is a validation loader that exists but is empty, and a validation loader that
    some ranks have and others lack. Unequal counts abort under ``error`` and run the minimum under
    ``truncate``.
    """
    empty_train = [r for r, c in counts.items() if c.train == 0]
    if empty_train:
        raise PolicyViolation(
            f"{format_ranks(empty_train)} {'has' if len(empty_train) == 1 else 'have'} an empty "
            "train loader (0 batches): give every rank at least one batch (a smaller batch size "
            "or fewer ranks)"
        )
    empty_valid = [r for r, c in counts.items() if c.valid == 0]
    if empty_valid:
        raise PolicyViolation(
            f"{format_ranks(empty_valid)} {'has' if len(empty_valid) == 1 else 'have'} an empty "
            "validation loader (0 batches): give every rank at least one validation batch, or "
            "pass no validation loader"
        )
    without_valid = [r for r, c in counts.items() if c.valid is None]
    if without_valid and len(without_valid) != len(counts):
        with_valid = [r for r in counts if r not in without_valid]
        raise PolicyViolation(
            f"{format_ranks(without_valid)} {'has' if len(without_valid) == 1 else 'have'} no "
            f"validation loader but {format_ranks(with_valid)} "
            f"{'does' if len(with_valid) == 1 else 'do'}: give every rank a validation loader, "
            "or none"
        )
    train = {r: c.train for r, c in counts.items()}
    valid = {r: c.valid for r, c in counts.items()}
    train_equal = len(set(train.values())) == 1
    valid_equal = len(set(valid.values())) == 1
    if policy == "error" and not (train_equal and valid_equal):
        kind = "train" if not train_equal else "validation"
        table = _by_count(train if not train_equal else valid)
        raise PolicyViolation(
            f"{table} {kind} batches: make every rank's loader yield the same number of "
            "batches, or run with --batch-policy truncate"
        )
    valid_batches = 0 if without_valid else min(v for v in valid.values() if v is not None)
    return EpochPlan(train_batches=min(train.values()), valid_batches=valid_batches)


def aggregate(reports: Mapping[int, LossSums]) -> tuple[float, float | None]:
    """Sample-weighted global (train, validation) loss; validation None when no rank validated.

    Raises PolicyViolation for a non-finite loss, a train loss over zero samples, or sample counts
    that add up past what a message carries.
    """
    for rank, r in reports.items():
        if not (math.isfinite(r.train_sum) and math.isfinite(r.valid_sum)):
            raise PolicyViolation(
                f"rank {rank} reported a non-finite loss (train sum {r.train_sum}, validation sum "
                f"{r.valid_sum}): training diverged; lower the learning rate or check the data"
            )
    train_count = count_total(
        {rank: r.train_count for rank, r in reports.items()}, "training sample"
    )
    if train_count == 0:
        raise PolicyViolation(
            "the ranks reported 0 training samples in total: a loss needs at least one sample"
        )
    train = _total(reports, "train") / train_count
    valid_count = count_total(
        {rank: r.valid_count for rank, r in reports.items()}, "validation sample"
    )
    if valid_count == 0:
        return train, None
    return train, _total(reports, "valid") / valid_count


def _total(reports: Mapping[int, LossSums], which: str) -> float:
    """The exact sum of every rank's ``which`` loss sum; PolicyViolation when it overflows.

    Each rank's sum is finite (checked above), but two sums near the float maximum still add up to
    more than a float holds: that is a diverged run too, and the ranks behind it are named.
    """
    sums = {rank: r.train_sum if which == "train" else r.valid_sum for rank, r in reports.items()}
    try:
        total = math.fsum(sums.values())
    except OverflowError:
        total = math.inf
    if math.isfinite(total):
        return total
    huge = sorted(sums, key=lambda rank: -abs(sums[rank]))[:2]
    shown = ", ".join(f"rank {rank} {sums[rank]:.3g}" for rank in sorted(huge))
    what = "training" if which == "train" else "validation"
    raise PolicyViolation(
        f"the {what} loss sums of {format_ranks(huge)} ({shown}) add up to more than a float "
        "holds: training diverged; lower the learning rate or check the data"
    )


def count_total(counts: Mapping[int, int], what: str) -> int:
    """The sum of every rank's ``counts``; PolicyViolation when it is past :data:`WIRE_INT_MAX`.

    The ranks named are the fewest whose counts alone overflow, the largest first: the ones
    reporting counts no training code produces.
    """
    total = sum(counts.values())
    if total <= WIRE_INT_MAX:
        return total
    culprits: list[int] = []
    running = 0
    for rank in sorted(counts, key=lambda r: (-counts[r], r)):
        culprits.append(rank)
        running += counts[rank]
        if running > WIRE_INT_MAX:
            break
    shown = ", ".join(f"rank {rank} {counts[rank]}" for rank in sorted(culprits)[:4])
    more = ", ..." if len(culprits) > 4 else ""
    raise PolicyViolation(
        f"the {what} counts of {format_ranks(culprits)} ({shown}{more}) add up to more than a "
        f"message can carry ({WIRE_INT_MAX}): the workers report counts no training produces; "
        "check the counts the training code returns"
    )


def aggregate_metrics(reports: Mapping[int, LossSums]) -> dict[str, MetricSums]:
    """Every named metric summed over the ranks: ``{"train": {name: (sum, count)}, "valid": ...}``.

    Sample-weighted by construction: the global value of a metric is the sum of every rank's sum
    over the sum of every rank's count, never a mean of the ranks' means. Raises PolicyViolation
    when a sum is not finite, when the counts add up past what a message carries, or when the
    ranks do not report the same metric names (a mean over some ranks only would silently leave
    the others' samples out).
    """
    out: dict[str, MetricSums] = {}
    for split in SPLITS:
        what = "training" if split == "train" else "validation"
        reporting = {rank: r.metrics(split) for rank, r in reports.items()}
        if split == "valid":  # ranks that did not validate this epoch report no validation metrics
            reporting = {rank: m for rank, m in reporting.items() if reports[rank].valid_count}
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for rank, metrics in reporting.items():
            groups[tuple(sorted(metrics))].append(rank)
        if len(groups) > 1:
            parts = [
                f"{format_ranks(ranks)} {', '.join(names) or 'none'}"
                for names, ranks in sorted(groups.items(), key=lambda kv: min(kv[1]))
            ]
            raise PolicyViolation(
                f"the ranks report different {what} metrics ({'; '.join(parts)}): every rank "
                "must compute the same metrics"
            )
        totals: MetricSums = {}
        for name in next(iter(groups), ()):
            sums = {rank: float(m[name][0]) for rank, m in reporting.items()}
            bad = sorted(rank for rank, v in sums.items() if not math.isfinite(v))
            try:
                total = math.fsum(sums.values())
            except OverflowError:
                total = math.inf
            if bad or not math.isfinite(total):
                culprits = bad or sorted(sums, key=lambda rank: -abs(sums[rank]))[:2]
                raise PolicyViolation(
                    f"the {what} metric {name!r} of {format_ranks(culprits)} is not finite "
                    f"({', '.join(f'{sums[r]:.3g}' for r in culprits)}): check the metric function"
                )
            counts = {rank: int(m[name][1]) for rank, m in reporting.items()}
            totals[name] = (total, count_total(counts, f"{what} metric {name!r} sample"))
        out[split] = totals
    return out


def metric_values(sums: Mapping[str, MetricSums]) -> dict[str, float]:
    """The global value of every metric with samples, by its journal key (``valid_accuracy``)."""
    return {
        f"{split}_{name}": total / count
        for split in SPLITS
        for name, (total, count) in sorted(sums.get(split, {}).items())
        if count > 0
    }


def metric_records(sums: MetricSums) -> tuple[Metric, ...]:
    """One split's summed metrics as they travel in a Decision."""
    return tuple(Metric(name, total, count) for name, (total, count) in sorted(sums.items()))


@dataclass(frozen=True, slots=True)
class EpochOutcome:
    """What the coordinator decided about one epoch."""

    epoch: int
    train_loss: float
    valid_loss: float | None
    smoothed_loss: float | None
    best_epoch: int | None
    best_loss: float | None
    is_best: bool
    stop: bool
    lr_factor: float = 1.0
    # the factor this epoch ran at
    next_lr_factor: float = 1.0
    # the factor the next epoch runs at (<= 0 stops the run)
    stop_reason: str | None = None
    # why the run stops after this epoch: "epochs", "lr_factor" or "patience"
    metrics: dict[str, float] = field(default_factory=dict)
    # every named metric's global value by its journal key: "train_accuracy", "valid_accuracy"

    def decision(
        self,
        checkpoint: bool,
        sums: Mapping[str, MetricSums] | None = None,
        go: Go | None = None,
    ) -> Decision:
        """The message every rank receives about this epoch (with the metrics' global ``sums``),
        carrying the ``go`` of the next epoch unless the run stops."""
        sums = sums or {}
        return Decision(
            epoch=self.epoch,
            train_loss=self.train_loss,
            valid_loss=self.valid_loss,
            smoothed_loss=self.smoothed_loss,
            best_epoch=self.best_epoch,
            is_best=self.is_best,
            checkpoint=checkpoint,
            stop=self.stop,
            train_metrics=metric_records(sums.get("train", {})),
            valid_metrics=metric_records(sums.get("valid", {})),
            go=go,
        )

    def record(
        self, *, validates: bool, checkpoint: bool, plan: EpochPlan, seconds: float
    ) -> dict[str, Any]:
        """This epoch's line in epochs.jsonl (the journal stamps its wall-clock ``time``); the
        fields of the outcome are what :class:`LoopState` replays on resume.

        Each metric is a flat numeric key (``"valid_accuracy": 0.96``) and ``metrics`` lists those
        keys, so a reader that plots every number finds them, and the replay finds them again."""
        fields = asdict(self)
        metrics = fields.pop("metrics")
        return {
            "kind": "epoch",
            **fields,
            **metrics,
            "metrics": sorted(metrics),
            "validates": validates,
            "checkpoint": checkpoint,
            "train_batches": plan.train_batches,
            "valid_batches": plan.valid_batches,
            "seconds": round(seconds, 6),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> EpochOutcome:
        """The outcome an epoch line of epochs.jsonl holds (its other fields are left aside);
        TypeError or KeyError when the line is not one."""
        given = {f.name: record[f.name] for f in fields(cls) if f.name in record}
        given["metrics"] = {key: float(record[key]) for key in record.get("metrics", ())}
        return cls(**given)


def checkpoint_after(config: CoordinatorConfig, outcome: EpochOutcome) -> bool:
    """Whether the workers checkpoint after ``outcome``'s epoch: every ``--checkpoint-every``-th
    and the last, and a new best whenever checkpoints are on (only with somewhere to put them)."""
    return config.checkpoint_path is not None and (
        config.checkpoints(outcome.epoch, last=outcome.stop)
        or (outcome.is_best and config.checkpoint_every > 0)
    )


def format_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``"  valid accuracy 0.9611"``: the validation metrics after the losses, or the training
    metrics in an epoch that did not validate (the journal keeps both)."""
    split = "valid" if any(key.startswith("valid_") for key in metrics) else "train"
    return "".join(
        f"  {split} {key[len(split) + 1 :]} {format_loss(value)}"
        for key, value in sorted(metrics.items())
        if key.startswith(f"{split}_")
    )


def format_epoch_line(outcome: EpochOutcome, epochs: int, seconds: float) -> str:
    """The one line per epoch a person follows a run by; ``smoothed`` and ``best`` are of the
    monitored value (the loss unless ``--monitor`` names a metric)."""
    best = (
        "-"
        if outcome.best_epoch is None
        else f"{outcome.best_epoch} ({format_loss(outcome.best_loss)})"
    )
    marker = " *" if outcome.is_best else ""
    return (
        f"epoch {outcome.epoch} [{outcome.epoch + 1}/{epochs}]  "
        f"train {format_loss(outcome.train_loss)}  valid {format_loss(outcome.valid_loss)}"
        f"{format_metrics(outcome.metrics)}  smoothed {format_loss(outcome.smoothed_loss)}  "
        f"lr x{outcome.lr_factor:g}  best {best}  "
        f"{seconds:.2f}s{marker}"
    )


def monitored_key(monitor: str, validates: bool) -> str:
    """The journal key of the monitored value: ``valid_NAME`` when the run validates, else
    ``train_NAME`` (``loss`` is ``valid_loss`` / ``train_loss``)."""
    return f"{'valid' if validates else 'train'}_{monitor}"


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
    smoothing: float = 1.0
    schedule: Schedule | None = None
    patience: int | None = None
    min_delta: float = 0.0
    best_from: int = 0
    monitor: str = "loss"
    mode: MonitorMode = "min"
    smoothed: float | None = None
    best_epoch: int | None = None
    best_loss: float | None = None
    lr_factor: float = 1.0
    schedule_state: dict[str, Any] = field(default_factory=dict)
    stale: int = 0
    # monitored epochs since the last improvement (for patience)
    history: list[EpochOutcome] = field(default_factory=list)

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
        names = ["loss"] + [
            k[len(split) + 1 :] for k in sorted(metrics) if k.startswith(f"{split}_")
        ]
        what = "validation" if validates else "training"
        raise PolicyViolation(
            f"--monitor {self.monitor}: the workers report no {what} metric of that name "
            f"(they report {', '.join(names)}): monitor one of those, or add "
            f"{self.monitor!r} to the training code's metrics"
        )

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
    ) -> EpochOutcome:
        """Record ``epoch``'s global losses and metrics (by journal key) and return the decision
        for it; PolicyViolation (nothing changed) when the monitored metric is not reported."""
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
        )
        self.history.append(outcome)
        return outcome
