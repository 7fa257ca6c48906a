"""One decided epoch: :class:`EpochOutcome`, and the shapes it takes on its way out.

The same outcome becomes the :class:`~epochal.protocol.Decision` every rank hears, the journal
record a resume replays (and reads back), and the epoch line the coordinator prints; one class
holds all three so they cannot drift apart. :func:`checkpoint_after` says whether the workers
checkpoint after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.batches import EpochPlan
from epochal.coordinator.rules.sums import MetricSums, metric_records
from epochal.protocol import Decision, Go
from epochal.rundir.paths import DEFAULT_MONITOR, rate_label, smoothed_label


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
    lr: float | None = None
    # the learning rate the workers' optimizer held (rank 0's report, else the first that says
    # it); None: no worker said it (a custom loop that does not pass learning_rate)

    def decision(
        self,
        checkpoint: bool,
        sums: Mapping[str, MetricSums] | None = None,
        go: Go | None = None,
        *,
        gather: bool = False,
    ) -> Decision:
        """The message every rank receives about this epoch (with the metrics' global ``sums``),
        carrying the ``go`` of the next epoch unless the run stops or the ranks ``gather`` the
        state for newcomers first."""
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
            gather=gather,
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


def format_data(position: Mapping[str, int]) -> str:
    """``"  pass 2 38%"``: where the data stands after an epoch of ``--steps-per-epoch`` steps
    (the epoch record's ``data_pass`` and the share of that pass consumed); empty where an epoch
    is one pass, or where the pass's size is not known."""
    if "data_pass" not in position:
        return ""
    whole = position["pass_batches"] * position["global_batch"]
    share = min(position["data_offset"] / whole, 1.0) if whole else 0.0
    return f"  pass {position['data_pass']} {share:.0%}"


def format_epoch_line(
    outcome: EpochOutcome,
    epochs: int,
    seconds: float,
    monitor: str = DEFAULT_MONITOR,
    position: Mapping[str, int] | None = None,
) -> str:
    """The one line per epoch a person follows a run by; ``smoothed`` and ``best`` are of the
    monitored value, named when it is not the loss (``--monitor``: ``smoothed accuracy``);
    ``position``: the epoch record's data fields, said after the epoch's number."""
    best = (
        "-"
        if outcome.best_epoch is None
        else f"{outcome.best_epoch} ({format_loss(outcome.best_loss)})"
    )
    marker = " *" if outcome.is_best else ""
    return (
        f"epoch {outcome.epoch} [{outcome.epoch + 1}/{epochs}]{format_data(position or {})}  "
        f"train {format_loss(outcome.train_loss)}  valid {format_loss(outcome.valid_loss)}"
        f"{format_metrics(outcome.metrics)}  {smoothed_label(monitor)} "
        f"{format_loss(outcome.smoothed_loss)}  "
        f"{rate_label(outcome.lr, outcome.lr_factor)}  best {best}  "
        f"{seconds:.2f}s{marker}"
    )
