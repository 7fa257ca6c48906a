"""Every rank's batch counts for an epoch, checked before any collective runs.

:func:`plan_epoch` turns the counts the ranks announced into the counts every rank runs, or raises
:class:`PolicyViolation` naming each rank's count and what to do (``--batch-policy``). Pure: the
machine passes the counts in (``tests/coordinator/test_policy.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from epochal.coordinator.config import BatchPolicy
from epochal.position import data_offset, position_at
from epochal.protocol import EpochReady


class PolicyViolation(Exception):
    """The inputs break a rule; the message says which rank, what, and how to fix it."""


@dataclass(frozen=True, slots=True)
class BatchCounts:
    """What one rank announced for an epoch (``valid`` None: no validation loader)."""

    train: int
    valid: int | None
    pass_batches: int | None = None
    # the global batches of one pass over its training data (runs with steps per epoch); None:
    # not known
    global_batch: int | None = None
    # the samples of one global batch; None: not known

    @classmethod
    def of(cls, ready: EpochReady) -> BatchCounts:
        """What ``ready`` announces."""
        return cls(ready.train_batches, ready.valid_batches, ready.pass_batches, ready.global_batch)


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """How many batches every rank runs this epoch (``valid_batches`` 0: no validation), and
    the shape of a pass every rank announced (None: not known)."""

    train_batches: int
    valid_batches: int
    pass_batches: int | None = None
    global_batch: int | None = None

    def position(self, epoch: int, steps_per_epoch: int | None) -> dict[str, int]:
        """The epoch record's data fields once ``epoch`` is trained: the global optimizer
        ``steps`` of an epoch, and, where the pass's shape is known, the pass the run stands
        in (``data_pass``) and the samples of that pass consumed (``data_offset``). Every epoch
        trains the same batches, so ``epoch + 1`` epochs consumed that many times
        ``train_batches`` global batches. Empty where an epoch is one pass."""
        if steps_per_epoch is None:
            return {}
        fields = {"steps": steps_per_epoch}
        if self.pass_batches is not None and self.global_batch is not None:
            at = position_at((epoch + 1) * self.train_batches, self.pass_batches)
            # every batch but a pass's last is full, so K*B bounds the pass's samples
            whole = self.pass_batches * self.global_batch
            fields["data_pass"] = at.data_pass
            fields["data_offset"] = data_offset(at, whole, self.global_batch)
            fields["pass_batches"] = self.pass_batches  # for the share of the pass done
            fields["global_batch"] = self.global_batch
        return fields


def last_plan(records: Iterable[Mapping[str, Any]]) -> EpochPlan | None:
    """The plan of the last epoch ``records`` (a journal's) hold; None: none, or not readable."""
    for record in reversed(list(records)):
        if record.get("kind") == "epoch":
            try:
                return EpochPlan(
                    int(record["train_batches"]),
                    int(record["valid_batches"]),
                    record.get("pass_batches"),
                    record.get("global_batch"),
                )
            except (KeyError, TypeError, ValueError):
                return None
    return None


def resliced(previous: EpochPlan | None, plan: EpochPlan, epoch: int) -> str | None:
    """What to say when ``epoch`` goes on with a pass begun in global batches of another size
    (None: nothing to say). A loader whose global batch follows the world size (a batch size per
    rank, as with a DistributedSampler) and whose world changed mid-pass, by a resume or an
    elastic change, reads other samples than the pass has left; ``epochal.batches`` keeps its
    global batch in every world. At a pass's start the new batches do no harm."""
    if previous is None or previous.pass_batches is None or plan.global_batch is None:
        return None
    if previous.global_batch in (None, plan.global_batch):
        return None
    data_pass, batch = divmod(epoch * previous.train_batches, previous.pass_batches)
    if batch == 0:
        return None
    return (
        f"epoch {epoch} goes on with pass {data_pass}, {batch} of its "
        f"{previous.pass_batches} global batches in, in global batches of {plan.global_batch} "
        f"samples where it read {previous.global_batch}: the training loader's global batch "
        "is its batch per rank times the world size, so the rest of this pass reads other "
        "samples than it has left, some twice and some never. Read the data with "
        "epochal.batches(dataset, global_batch=...), the same global batch in every world, or "
        "keep the world size within a pass"
    )


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
    same = _all_alike(counts)
    if same is not None and same.train != 0 and same.valid != 0:  # the usual: nothing to check
        return EpochPlan(same.train, same.valid or 0, same.pass_batches, same.global_batch)
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
    shape = _pass_shape(counts)
    return EpochPlan(min(train.values()), valid_batches, *shape)


def _all_alike(counts: Mapping[int, BatchCounts]) -> BatchCounts | None:
    """What every rank announced, when they all announced the same; else None. One pass over
    thousands of ranks, where the checks below take several."""
    values = iter(counts.values())
    first = next(values, None)
    return first if first is not None and all(map(first.__eq__, values)) else None


def _pass_shape(counts: Mapping[int, BatchCounts]) -> tuple[int | None, int | None]:
    """The (global batches per pass, samples per global batch) every rank announced, or
    PolicyViolation naming each rank's: ranks that disagree read different data positions."""
    shapes = {r: (c.pass_batches, c.global_batch) for r, c in counts.items()}
    if len(set(shapes.values())) == 1:
        return next(iter(shapes.values()))
    groups: dict[tuple[int | None, int | None], list[int]] = defaultdict(list)
    for rank, shape in shapes.items():
        groups[shape].append(rank)
    said = ", ".join(
        f"{format_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} "
        + ("no known pass" if k is None else f"{k} global batches of {b or '?'} samples a pass")
        for (k, b), ranks in sorted(groups.items(), key=lambda kv: (len(kv[1]), min(kv[1])))
    )
    raise PolicyViolation(
        f"{said}: every rank must read the same data, in global batches of the same size "
        "(the same dataset, batch size and drop_last on every rank)"
    )
