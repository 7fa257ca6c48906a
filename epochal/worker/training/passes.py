"""A batch sampler that reads the run's data position: :class:`PassSampler`.

It turns a :class:`~epochal.position.DataPosition` into this rank's batches of a map-style
dataset, by the math in ``epochal/position.py``: pass ``p``'s permutation is
``torch.randperm(n, generator=torch.Generator().manual_seed(seed + p))`` (the identity without
shuffling), the same on every rank and the one ``DistributedSampler`` draws; global batch ``k``
is ``perm[k*B : (k+1)*B]``; this rank takes ``[rank::world]`` of it. Starting at a position costs
one permutation (O(n), milliseconds for a million samples) and a slice: no sample is loaded and
no earlier batch is drawn.

The sampler does not count what was consumed: a ``DataLoader`` with workers draws batches ahead
of training, so the sampler's own count would run ahead of the steps taken. The trainer counts
its steps and derives the position (:func:`~epochal.position.position_at`), then sets it here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from epochal.errors import ConfigError
from epochal.position import (
    DataPosition,
    advance,
    batch_bounds,
    batches_before,
    batches_per_pass,
    check_world,
    position_at,
)


class PassSampler(Sampler[list[int]]):
    """This rank's batches of a pass over ``data`` (a sized dataset, or its length), from a
    :class:`DataPosition`.

    ``global_batch`` is fixed for the run, whatever the world size; ``world`` must divide it
    (:func:`~epochal.position.check_world` says which sizes do). With ``endless`` the iteration
    does not stop at the end of a pass: the next pass, with its own shuffle, follows, so an
    epoch of N steps takes its N batches across a pass boundary. ``len()`` is the batches left
    in the current pass from the position either way.
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        global_batch: int,
        rank: int,
        world: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        endless: bool = False,
    ) -> None:
        self.samples = data if isinstance(data, int) else len(data)
        self.batches = batches_per_pass(self.samples, global_batch, drop_last=drop_last)
        check_world(world, global_batch, samples=self.samples, drop_last=drop_last)
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} is outside a world of {world} workers")
        self.global_batch = global_batch
        self.rank = rank
        self.world = world
        self.seed = seed
        self.shuffle = shuffle
        self.endless = endless
        self.position = DataPosition(0, 0, seed)
        self._perm: tuple[int, torch.Tensor] | None = None  # (pass, its permutation)

    def set_position(self, position: DataPosition) -> None:
        """Start the next iteration at ``position`` (a pass's end is the next pass's start)."""
        if position.seed != self.seed:
            raise ConfigError(
                f"the data position has seed {position.seed}, this sampler {self.seed}: build "
                f"the sampler with seed={position.seed}, the run's data seed"
            )
        # normalises batch == K to the next pass's 0, and refuses a batch past the pass
        self.position = advance(position, 0, self.batches)

    def set_epoch(self, epoch: int) -> None:
        """An epoch that is one pass: start pass ``epoch`` from its first batch."""
        self.set_position(DataPosition(epoch, 0, self.seed))

    def permutation(self, data_pass: int) -> torch.Tensor:
        """Pass ``data_pass``'s order of the sample indices, the same on every rank."""
        if self._perm is not None and self._perm[0] == data_pass:
            return self._perm[1]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + data_pass)
            perm = torch.randperm(self.samples, generator=generator)
        else:
            perm = torch.arange(self.samples)
        self._perm = (data_pass, perm)
        return perm

    def global_batch_indices(self, position: DataPosition) -> torch.Tensor:
        """Every rank's samples of the global batch at ``position``, in permutation order."""
        start, stop = batch_bounds(position.batch, self.samples, self.global_batch)
        return self.permutation(position.data_pass)[start:stop]

    def __iter__(self) -> Iterator[list[int]]:
        position = self.position
        while True:
            perm = self.permutation(position.data_pass)
            for batch in range(position.batch, self.batches):
                start, stop = batch_bounds(batch, self.samples, self.global_batch)
                yield perm[start + self.rank : stop : self.world].tolist()
            if not self.endless:
                return
            position = DataPosition(position.data_pass + 1, 0, self.seed)

    def __len__(self) -> int:
        return self.batches - self.position.batch

    def consumed(self) -> int:
        """Global batches the run consumed to stand at the set position (for the trainer's
        step counter on a resume)."""
        return batches_before(self.position, self.batches)


_OWN = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
"""DataLoader arguments :func:`batches` decides itself."""


@dataclass(frozen=True, slots=True)
class PassBatches:
    """A dataset to read in global batches of a fixed size, each rank its share: what
    :func:`batches` returns and :func:`~epochal.worker.training.train.fit` turns into this
    rank's ``DataLoader`` over a :class:`PassSampler` once the rank and world are known."""

    dataset: Sized
    global_batch: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    # further DataLoader arguments (num_workers, collate_fn, pin_memory, ...)

    def shape(self) -> tuple[int, int]:
        """(global batches of a pass, samples of a global batch): what
        :meth:`~epochal.worker.session.Session.run_epochs` takes as ``passes=`` to give each
        epoch's context its pass, and the journal the data position."""
        whole = batches_per_pass(len(self.dataset), self.global_batch, drop_last=self.drop_last)
        return whole, self.global_batch

    def loader(
        self, rank: int, world: int, *, endless: bool = False, start: int = 0
    ) -> DataLoader[Any]:
        """Rank ``rank``'s loader in a world of ``world``: ConfigError naming the world sizes
        that split the global batch evenly when ``world`` does not. It starts after ``start``
        global batches of the run (a custom loop's ``ctx.batches_done``), at the pass and batch
        they reach, without loading a sample before."""
        sampler = PassSampler(
            self.dataset,
            global_batch=self.global_batch,
            rank=rank,
            world=world,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            endless=endless,
        )
        sampler.set_position(position_at(start, sampler.batches, seed=self.seed))
        return DataLoader(self.dataset, batch_sampler=sampler, **self.options)  # type: ignore[arg-type]


def batches(
    dataset: Sized,
    *,
    global_batch: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **dataloader_kwargs: Any,
) -> PassBatches:
    """``dataset`` read in global batches of ``global_batch`` samples, every rank together.

    Give it to :func:`epochal.train` as a loader: each rank reads its strided share of each
    global batch, so the batches, and the result, do not depend on the world size, which must
    divide ``global_batch`` (refused before training otherwise, naming the sizes that do). Pass
    ``p`` shuffles with ``seed + p``. With ``--steps-per-epoch`` a pass runs on across epochs,
    and a resume, at any world size that divides ``global_batch``, starts at the next batch
    without loading the samples before it. ``dataloader_kwargs`` go to ``DataLoader``
    (``num_workers``, ``collate_fn``, ...), except the batching ones, which this decides.
    """
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        raise ConfigError(
            f"batches() reads a map-style dataset, with len(); got a "
            f"{type(dataset).__name__}: pass a stream's own DataLoader to train() instead, "
            "with --steps-per-epoch"
        )
    if type(global_batch) is not int or global_batch < 1:
        raise ConfigError(f"global_batch must be a whole number >= 1, got {global_batch!r}")
    given = sorted(set(dataloader_kwargs) & set(_OWN))
    if given:
        raise ConfigError(
            f"batches() decides {', '.join(given)} itself: pass global_batch=, shuffle= and "
            "drop_last= instead"
        )
    batches_per_pass(len(dataset), global_batch, drop_last=drop_last)  # an empty pass refused
    return PassBatches(dataset, global_batch, shuffle, seed, drop_last, dict(dataloader_kwargs))
