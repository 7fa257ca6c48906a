"""This rank's training batches when an epoch is N optimizer steps (``--steps-per-epoch``).

A :class:`Feed` keeps one iterator over the loader across the epochs of a pass, so a loader's
worker processes are not started again at each epoch, and an epoch takes exactly its batches
from where the last one stopped. When the pass ends inside an epoch the next pass starts there:
``set_epoch(pass)`` on the loader's samplers (a ``DistributedSampler`` shuffles anew), or the
next permutation of an endless :class:`~.passes.PassSampler`.

Where the data stands follows from the epoch alone: epoch ``e`` starts after ``e`` times the
epoch's batches, the position :func:`~epochal.position.position_at` gives for the pass's
length. An epoch that does not start where the iterator stands (a resume, an epoch redone in a
new world) puts the loader there first, without loading a consumed sample:
:meth:`PassSampler.set_position`, or :func:`~.positioning.skip_consumed` for a loader of the
user's own. A stream (an ``IterableDataset``) has no such position: only a loader with
``state_dict()`` / ``load_state_dict()`` (torchdata's ``StatefulDataLoader``) can say where it
stands. The feed takes that state at each epoch's end, after its last batch was trained on, for
the rank's checkpoint (:meth:`Feed.rank_state`), and puts the loader back there on a resume at
the same world size; any other stream, or another world size, is refused there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from epochal.errors import ConfigError
from epochal.position import DataPosition, position_at
from epochal.worker.training.passes import PassSampler
from epochal.worker.training.positioning import (
    StatefulLoader,
    has_len,
    set_epochs,
    set_stream_position,
    skip_consumed,
    stream_position,
)

_SEEDS = 0x5EED_0F_9A55
"""Mixed with a pass and a batch into the seed a new iterator draws its workers' base seed with
(see :meth:`Feed._fresh`)."""


class Feed:
    """``batches_per_epoch`` batches of ``loader`` an epoch, across passes; see the module
    docstring. ``world`` is the world size, for the global batch of a loader of the user's, and
    with ``rank`` says whose a stream's position is."""

    def __init__(
        self, loader: Iterable[Any], batches_per_epoch: int, world: int, rank: int = 0
    ) -> None:
        self.loader = loader
        self.batches_per_epoch = batches_per_epoch
        self.world, self.rank = world, rank
        batch_sampler = getattr(loader, "batch_sampler", None)
        self.sampler = batch_sampler if isinstance(batch_sampler, PassSampler) else None
        self.pass_batches: int | None = None
        """Global batches of one pass (every rank takes one batch of each); None: a stream."""
        self.global_batch: int | None = None
        """Samples of one global batch; None: not known."""
        if self.sampler is not None:
            self.pass_batches, self.global_batch = self.sampler.batches, self.sampler.global_batch
        elif has_len(loader):
            self.pass_batches = len(loader)  # type: ignore[arg-type]
            size = getattr(loader, "batch_size", None)
            self.global_batch = size * world if isinstance(size, int) else None
        self._iterator: Iterator[Any] | None = None
        self._pass = 0
        self._at: int | None = None
        """Global batches the run consumed where the iterator stands; None: no iterator."""
        self.stateful = self.pass_batches is None and isinstance(loader, StatefulLoader)
        """A stream whose loader can say where it stands."""
        self._ended: dict[str, Any] | None = None
        """A stateful stream's position at the end of the last epoch it fed."""
        self._resumed: dict[str, Any] | None = None
        """The position a checkpoint held for this rank, until the epoch after it starts."""
        self._loaded = False
        """Whether a checkpoint was loaded (its position, or none, is in :attr:`_resumed`)."""

    def shape(self) -> tuple[int | None, int | None]:
        """(global batches of a pass, samples of a global batch), as the epoch's ready says."""
        return self.pass_batches, self.global_batch

    def epoch(self, epoch: int) -> Iterator[Any]:
        """Epoch ``epoch``'s batches, exactly :attr:`batches_per_epoch` of them."""
        start = epoch * self.batches_per_epoch
        if self._at != start:
            self._seek(start)
        for _ in range(self.batches_per_epoch):
            batch = self._next()
            self._at = (self._at or 0) + 1  # counted as handed out: a prefetched one is not
            yield batch
        if self.stateful:  # asked for after the last batch trained on: the epoch's end
            at = {"world": self.world, "rank": self.rank, "at": self._at, "pass": self._pass}
            self._ended = {**at, "state": stream_position(self.loader)}

    def rank_state(self) -> dict[str, Any] | None:
        """What this rank's checkpoint keeps of the feed: a stateful stream's position at the
        end of the last epoch (None: nothing, the position follows from the epoch)."""
        return self._ended

    def load_rank_state(self, saved: Any) -> None:
        """Take what a checkpoint kept for this rank (None: nothing), for the next epoch."""
        self._resumed = saved if isinstance(saved, dict) else None
        self._loaded = True

    def _seek(self, consumed: int) -> None:
        """Stand after ``consumed`` global batches of the run."""
        if self.pass_batches is None:
            if consumed != 0 and self.stateful and self._loaded:
                self._resume_stream(consumed)
                return
            if consumed != 0:
                raise ConfigError(
                    f"the training loader reads a stream ({type(self.loader).__name__} without "
                    f"len()), which cannot be put back {consumed} batches in: a run over a "
                    "stream resumes, or redoes an epoch in a new world, only from its start. "
                    "Start it afresh (--fresh), or read a map-style dataset (epochal.batches)"
                )
            self._pass, self._at = 0, 0
            self._iterator = self._fresh(self.loader, 0, 0)
            return
        at = position_at(consumed, self.pass_batches, seed=self._seed())
        self._pass, self._at = at.data_pass, consumed
        if self.sampler is not None:
            self.sampler.set_position(at)
            self._iterator = self._fresh(self.loader, at.data_pass, at.batch)
        elif at.batch == 0:
            set_epochs(self.loader, at.data_pass)
            self._iterator = self._fresh(self.loader, at.data_pass, 0)
        else:  # the consumed batches' indices drawn and dropped, none of their samples loaded
            rest = skip_consumed(self.loader, at.data_pass, at.batch)  # type: ignore[arg-type]
            self._iterator = self._fresh(rest, at.data_pass, at.batch)

    def _resume_stream(self, consumed: int) -> None:
        """Put a stateful stream where this rank's checkpoint says it stood after ``consumed``
        global batches, or refuse: the position is that rank's, in that world."""
        saved, self._resumed = self._resumed, None
        fix = (
            "each rank's stream position belongs to that rank, so a stream resumes only at the "
            "world size it ran at. Resume it at that size, or read a map-style dataset with "
            "epochal.batches, whose position any world size can take"
        )
        if saved is None:
            raise ConfigError(
                f"the checkpoint holds no stream position for rank {self.rank} of this world of "
                f"{self.world} (it was written by a smaller world, or before streams kept one): "
                + fix
            )
        if saved["world"] != self.world:
            raise ConfigError(
                f"the checkpoint's stream positions are those of a world of {saved['world']}, "
                f"and this world has {self.world}: " + fix
            )
        if saved["at"] != consumed:
            raise ConfigError(
                f"rank {self.rank}'s stream position is {saved['at']} batches in, but the epoch "
                f"starts {consumed} in: a stream is put back only where a checkpoint left it. "
                "Start it afresh (--fresh), or read a map-style dataset (epochal.batches)"
            )
        set_stream_position(self.loader, saved["state"])
        self._pass, self._at = saved["pass"], consumed
        self._iterator = self._fresh(self.loader, self._pass, consumed)

    def _seed(self) -> int:
        return self.sampler.seed if self.sampler is not None else 0

    def _next(self) -> Any:
        if self._iterator is None:
            self._seek(0)
        assert self._iterator is not None
        try:
            return next(self._iterator)
        except StopIteration:  # the pass ended inside the epoch: the next starts here
            pass
        self._pass += 1
        if self.sampler is not None:
            self.sampler.set_position(DataPosition(self._pass, 0, self.sampler.seed))
        else:
            set_epochs(self.loader, self._pass)
        self._iterator = self._fresh(self.loader, self._pass, 0)
        try:
            return next(self._iterator)
        except StopIteration:
            raise ConfigError(
                f"the training loader yields no batch in pass {self._pass}: give it data"
            ) from None

    @staticmethod
    def _fresh(loader: Iterable[Any], data_pass: int, batch: int) -> Iterator[Any]:
        """A new iterator over ``loader`` at pass ``data_pass``, batch ``batch``.

        A ``DataLoader`` draws its workers' base seed from torch's global generator each time
        it is iterated: here from a seed of the position instead, the global generator left as
        it was, so a run resumed mid-pass trains on the very random numbers an unbroken one
        does (and its workers' seeds still change from pass to pass)."""
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(_SEEDS + data_pass * 1_000_003 + batch)
            return iter(loader)
