"""The run's data position: which samples every rank reads next, from three numbers.

With ``--steps-per-epoch N`` an epoch (the coordinator's unit of decision) and a pass (one walk
over the data) part. The data position then belongs to the run, not to a rank: a
:class:`DataPosition` (pass, global batches of that pass consumed, seed). It is world-free, so
a resume, or a new world after an elastic change, starts at the next batch at once, without
loading a sample. The math, for a map-style dataset of ``n`` samples and a fixed global batch of
``B`` samples (the same whatever the world size):

- **Passes.** Pass ``p`` walks one permutation of ``range(n)``, the same on every rank: drawn
  from ``seed + p`` when shuffling (``worker/training/passes.py`` draws it), the identity when
  not.
- **Global batches.** Global batch ``k`` of a pass is the slice ``[k*B, (k+1)*B)`` of the
  permutation. A pass holds ``K = ceil(n / B)`` of them, the last one ``m = n - (K-1)*B``
  samples (smaller than ``B`` when ``B`` does not divide ``n``), or ``K = n // B`` with
  ``drop_last``, whose ``n mod B`` left-over samples that pass skips (the next pass, shuffled
  anew, puts other samples last).
- **Counter to position.** A run that has consumed ``g`` global batches (global optimizer steps
  times the batches each step accumulates) stands at pass ``g // K``, batch ``g % K``
  (:func:`position_at`); :func:`batches_before` is the inverse. A run at the very end of a pass
  stands at the next pass's batch 0, never at batch ``K``.
- **Samples.** Batch ``k`` of a pass starts at sample ``min(k*B, n)`` of its permutation
  (:func:`data_offset`).
- **Ranks.** Rank ``r`` of a world of ``W`` takes the strided share ``batch[r::W]`` of each
  global batch (:func:`split`). Strided rather than contiguous because it is what
  ``DistributedSampler`` gives: its rank ``r`` reads ``perm[r::W]``, and its ``k``-th batch of
  ``B/W`` samples is exactly ``perm[k*B : (k+1)*B][r::W]``, drawn from the same
  ``randperm(n, seed + p)``. A script moving from ``DistributedSampler`` keeps its data order
  sample for sample, and the union of the shares is the global batch whatever ``W``.
- **Worlds.** ``W`` must divide ``B``, so every rank's full batch holds ``B/W`` samples and the
  gradient average weighs every sample alike at every world size (:func:`check_world` names the
  sizes that do). The last, partial global batch of ``m`` samples is shared unevenly: the first
  ``m mod W`` ranks take one sample more. A world larger than ``m`` would leave a rank an empty
  batch, which the batch check refuses mid-run, so :func:`check_world` refuses it up front, and
  names the fixes (``drop_last``, or at most ``m`` workers). ``K`` depends on ``n``, ``B`` and
  ``drop_last`` only, never on ``W``, so a position means the same in every world.

Pure and torch-free: the coordinator, which never imports torch, can decide and journal
positions with the same functions the workers read them with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from epochal.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Where the run's data stands: the next global batch to train on.

    Counts only batches trained on: a loader's prefetched batches are not consumed (a resume
    from a count that included them would skip samples no step saw).
    """

    data_pass: int
    """The pass, counted from 0 for the run (not per epoch: a pass runs on across epochs)."""
    batch: int
    """Global batches of ``data_pass`` already consumed, by every rank together."""
    seed: int = 0
    """The run's data seed; pass ``p`` shuffles with ``seed + p``."""

    def __post_init__(self) -> None:
        if self.data_pass < 0 or self.batch < 0:
            raise ConfigError(
                f"a data position counts up from 0, got pass {self.data_pass}, batch "
                f"{self.batch}: build it with position_at(global_batches, batches_per_pass)"
            )


def batches_per_pass(samples: int, global_batch: int, *, drop_last: bool = False) -> int:
    """``K``: the global batches of one pass over ``samples`` samples.

    ``ceil(samples / global_batch)``, the last batch smaller when ``global_batch`` does not
    divide ``samples``; with ``drop_last`` the full batches only, ``samples // global_batch``.
    """
    if global_batch < 1:
        raise ConfigError(f"the global batch must hold at least 1 sample, got {global_batch}")
    if samples < 1:
        raise ConfigError(f"the dataset holds {samples} samples: a pass needs at least one")
    if drop_last:
        if samples < global_batch:
            raise ConfigError(
                f"the dataset holds {samples} samples, fewer than one global batch of "
                f"{global_batch}, and drop_last drops them all: use a global batch of at most "
                f"{samples}, or keep the partial batch (drop_last=False)"
            )
        return samples // global_batch
    return -(-samples // global_batch)


def _check_batches(batches: int) -> None:
    if batches < 1:
        raise ConfigError(f"a pass holds at least one global batch, got {batches}")


def position_at(global_batches: int, batches_per_pass: int, *, seed: int = 0) -> DataPosition:
    """The position after ``global_batches`` global batches consumed since the run began.

    ``global_batches`` is global optimizer steps times the batches each step accumulates.
    Pass ``g // K``, batch ``g % K``: the end of a pass is the next pass's start.
    """
    _check_batches(batches_per_pass)
    if global_batches < 0:
        raise ConfigError(f"a run consumes 0 or more global batches, got {global_batches}")
    data_pass, batch = divmod(global_batches, batches_per_pass)
    return DataPosition(data_pass, batch, seed)


def batches_before(position: DataPosition, batches_per_pass: int) -> int:
    """The global batches a run consumed to stand at ``position``: the inverse of
    :func:`position_at`. Accepts ``batch == K`` (a pass just ended) as the next pass's start."""
    _check_batches(batches_per_pass)
    if position.batch > batches_per_pass:
        raise ConfigError(
            f"position {position} lies past the end of a pass of {batches_per_pass} global "
            "batches: was it taken with another dataset size or global batch?"
        )
    return position.data_pass * batches_per_pass + position.batch


def advance(position: DataPosition, batches: int, batches_per_pass: int) -> DataPosition:
    """``position`` moved on by ``batches`` global batches, across passes when it gets there."""
    return position_at(
        batches_before(position, batches_per_pass) + batches, batches_per_pass, seed=position.seed
    )


def data_offset(position: DataPosition, samples: int, global_batch: int) -> int:
    """The samples of ``position.data_pass``'s permutation consumed before ``position``:
    ``min(batch * B, n)``."""
    return min(position.batch * global_batch, samples)


def batch_bounds(batch: int, samples: int, global_batch: int) -> tuple[int, int]:
    """``[start, stop)``: where global batch ``batch`` lies in its pass's permutation."""
    start = batch * global_batch
    if batch < 0 or start >= samples:
        raise ConfigError(
            f"global batch {batch} lies outside a pass of {samples} samples in batches of "
            f"{global_batch}"
        )
    return start, min(start + global_batch, samples)


def split(global_batch_indices: Sequence[T], rank: int, world: int) -> Sequence[T]:
    """Rank ``rank``'s share of one global batch: ``indices[rank::world]`` (strided, as
    ``DistributedSampler`` shares; the module docstring says why). Works on lists, ranges and
    1-D tensors."""
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside a world of {world} workers")
    return global_batch_indices[rank::world]


def worlds_that_split(global_batch: int) -> list[int]:
    """Every world size that splits ``global_batch`` evenly (its divisors), ascending."""
    if global_batch < 1:
        raise ConfigError(f"the global batch must hold at least 1 sample, got {global_batch}")
    low = [d for d in range(1, int(global_batch**0.5) + 1) if global_batch % d == 0]
    return sorted({*low, *(global_batch // d for d in low)})


def check_world(
    world: int, global_batch: int, *, samples: int | None = None, drop_last: bool = False
) -> None:
    """Raise :class:`ConfigError` unless ``world`` workers can share every global batch.

    ``world`` must divide ``global_batch``; given ``samples``, and without ``drop_last``, a
    last partial global batch must also hold at least one sample per worker.
    """
    if world < 1:
        raise ConfigError(f"a world holds at least 1 worker, got {world}")
    sizes = worlds_that_split(global_batch)
    if world not in sizes:
        raise ConfigError(
            f"a global batch of {global_batch} splits evenly over "
            f"{', '.join(map(str, sizes))} workers, not {world}: run with one of those world "
            f"sizes, or pick a global batch that {world} divides (e.g. "
            f"{global_batch + (-global_batch) % world})"
        )
    if samples is None or drop_last:
        return
    last = samples - (batches_per_pass(samples, global_batch) - 1) * global_batch
    if last < world:
        raise ConfigError(
            f"the last global batch of each pass holds {last} samples ({samples} samples in "
            f"batches of {global_batch}), fewer than the {world} workers: some would get an "
            f"empty batch. Drop it (drop_last=True), or run with at most {last} workers"
        )
