"""Each rank's loss and metric sums for an epoch, added up sample-weighted across ranks.

:func:`aggregate` turns per-rank loss sums into the global losses and :func:`aggregate_metrics`
does the same for the training code's named metrics; every count is checked against what a
message can carry. Pure (``tests/coordinator/test_policy.py``, ``test_metrics.py``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from epochal.coordinator.rules.batches import PolicyViolation, format_ranks
from epochal.protocol.messages import Metric

MetricSums = dict[str, tuple[float, int]]
"""Named metrics of one split as ``name -> (sum over samples, sample count)``."""

WIRE_INT_MAX = 2**64 - 1
"""The largest integer a message carries (msgpack's unsigned 64 bits). Every count the coordinator
adds up is checked against it: each rank's count fits, but their sum may not, and a sum that
cannot be sent would crash the encoder of the decision instead of aborting the run."""

SPLITS = ("train", "valid")


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


def aggregate(reports: Mapping[int, LossSums]) -> tuple[float, float | None]:
    """Sample-weighted global (train, validation) loss; validation None when no rank validated.

    Raises PolicyViolation for a non-finite loss, a train loss over zero samples, or sample counts
    that add up past what a message carries.
    """
    values = list(reports.values())
    finite = math.isfinite
    if not all(finite(r.train_sum) and finite(r.valid_sum) for r in values):
        for rank, r in reports.items():
            if not (finite(r.train_sum) and finite(r.valid_sum)):
                raise PolicyViolation(
                    f"rank {rank} reported a non-finite loss (train sum {r.train_sum}, validation "
                    f"sum {r.valid_sum}): training diverged; lower the learning rate or check the "
                    "data"
                )
    train_count = sum(r.train_count for r in values)
    if train_count > WIRE_INT_MAX:
        count_total({rank: r.train_count for rank, r in reports.items()}, "training sample")
    if train_count == 0:
        raise PolicyViolation(
            "the ranks reported 0 training samples in total: a loss needs at least one sample"
        )
    train = _total(reports, "train") / train_count
    valid_count = sum(r.valid_count for r in values)
    if valid_count > WIRE_INT_MAX:
        count_total({rank: r.valid_count for rank, r in reports.items()}, "validation sample")
    if valid_count == 0:
        return train, None
    return train, _total(reports, "valid") / valid_count


def _total(reports: Mapping[int, LossSums], which: str) -> float:
    """The exact sum of every rank's ``which`` loss sum; PolicyViolation when it overflows.

    Each rank's sum is finite (checked above), but two sums near the float maximum still add up to
    more than a float holds: that is a diverged run too, and the ranks behind it are named.
    """
    values = [r.train_sum if which == "train" else r.valid_sum for r in reports.values()]
    total = _finite_sum(values)
    if total is not None:
        return total
    sums = dict(zip(reports, values, strict=True))
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
        ranks = list(reports)
        if split == "valid":  # ranks that did not validate this epoch report no validation metrics
            ranks = [rank for rank in ranks if reports[rank].valid_count]
        reporting = [reports[rank].metrics(split) for rank in ranks]
        totals: MetricSums = {}
        for name in _names(ranks, reporting, what):
            sums = [float(m[name][0]) for m in reporting]
            total = _finite_sum(sums)
            if total is None:
                by_rank = dict(zip(ranks, sums, strict=True))
                bad = sorted(rank for rank, v in by_rank.items() if not math.isfinite(v))
                culprits = bad or sorted(by_rank, key=lambda rank: -abs(by_rank[rank]))[:2]
                raise PolicyViolation(
                    f"the {what} metric {name!r} of {format_ranks(culprits)} is not finite "
                    f"({', '.join(f'{by_rank[r]:.3g}' for r in culprits)}): check the metric "
                    "function"
                )
            counts = [int(m[name][1]) for m in reporting]
            count = sum(counts)
            if count > WIRE_INT_MAX:
                count_total(dict(zip(ranks, counts, strict=True)), f"{what} metric {name!r} sample")
            totals[name] = (total, count)
        out[split] = totals
    return out


def _names(
    ranks: list[int], reporting: list[Mapping[str, tuple[float, int]]], what: str
) -> list[str]:
    """The metric names every one of ``ranks`` reports (``reporting``, in the same order), sorted;
    PolicyViolation saying which ranks report which names when they differ."""
    first = reporting[0].keys() if reporting else {}.keys()
    if all(m.keys() == first for m in reporting):
        return sorted(first)
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for rank, metrics in zip(ranks, reporting, strict=True):
        groups[tuple(sorted(metrics))].append(rank)
    parts = [
        f"{format_ranks(ranks)} {', '.join(names) or 'none'}"
        for names, ranks in sorted(groups.items(), key=lambda kv: min(kv[1]))
    ]
    raise PolicyViolation(
        f"the ranks report different {what} metrics ({'; '.join(parts)}): every rank must "
        "compute the same metrics"
    )


def _finite_sum(values: list[float]) -> float | None:
    """The exact sum of ``values``; None when one is not finite or the sum overflows."""
    if not all(map(math.isfinite, values)):
        return None
    try:
        total = math.fsum(values)
    except OverflowError:
        return None
    return total if math.isfinite(total) else None


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
