"""Putting a loader epochal does not own at the run's data position.

A user's own ``DataLoader`` (a ``DistributedSampler``, or any sampler or batch sampler) cannot
read a :class:`~epochal.position.DataPosition` the way :class:`~.passes.PassSampler` does, but
its batches of a pass are fixed once the pass is known (``set_epoch``). :func:`skip_consumed`
returns a loader over the same dataset, collate function, workers, pinning and seeds whose batch
sampler starts after the consumed batches: it draws the consumed batches' indices from the batch
sampler and throws them away, which costs a few microseconds a batch, and never passes them to
the dataset, which is what loading costs (the ``__getitem__`` of every sample, in the workers).

A stream (an ``IterableDataset``) has no indices to skip: only the loader itself can say where
it stands. :func:`stream_position` and :func:`set_stream_position` use the ``state_dict()`` /
``load_state_dict()`` pair of a loader that has them (torchdata's ``StatefulDataLoader``), and
refuse any other loader with what to use instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler

from epochal.errors import ConfigError

T = TypeVar("T")


class _Skipped(Sampler[T]):
    """``inner`` without its first ``skip`` items: they are drawn and dropped, never loaded."""

    def __init__(self, inner: Iterable[T], skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        if not isinstance(self.inner, Sized):
            raise TypeError(f"{type(self.inner).__name__} has no len()")
        return max(0, len(self.inner) - self.skip)


def has_len(loader: object) -> bool:
    """Whether ``len(loader)`` answers: a ``DataLoader`` over a stream (an ``IterableDataset``)
    has ``__len__`` but raises TypeError from it unless the stream has one."""
    try:
        len(loader)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _set_epoch(sampler: object, data_pass: int) -> None:
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(data_pass)


def set_epochs(loader: object, number: int) -> None:
    """``set_epoch(number)`` on ``loader``'s sampler and batch sampler, those that have it: what
    epochal calls on a training loader at each epoch (or each pass, with steps per epoch)."""
    for holder in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        _set_epoch(holder, number)


def skip_consumed(loader: DataLoader[Any], data_pass: int, consumed: int) -> DataLoader[Any]:
    """A loader like ``loader`` that yields pass ``data_pass`` from its batch ``consumed`` on.

    Calls ``set_epoch(data_pass)`` on the sampler and batch sampler that have it (a
    ``DistributedSampler`` shuffles with ``seed + epoch``: the pass is its epoch). The loader's
    order must be a function of the pass for the tail to be the one a run without a resume would
    have read; a ``RandomSampler`` without a generator draws a new order from torch's global
    random state at every iteration, and is refused.
    """
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError(
            f"the loader reads a stream ({type(loader.dataset).__name__}, an IterableDataset): "
            "it has no batches to skip without reading them. Use a loader with state_dict() "
            "and load_state_dict(), such as torchdata's StatefulDataLoader, with "
            "stream_position() / set_stream_position()"
        )
    if consumed < 0:
        raise ConfigError(f"a pass's consumed batches count up from 0, got {consumed}")
    if isinstance(loader.sampler, RandomSampler) and loader.sampler.generator is None:
        raise ConfigError(
            "the loader shuffles with a RandomSampler that has no generator (shuffle=True "
            "without generator=): its order comes from torch's global random state at each "
            "iteration, so a resumed run would skip other samples than it consumed. Use a "
            "DistributedSampler (seed=, set_epoch) or epochal's PassSampler"
        )
    set_epochs(loader, data_pass)
    _set_epoch(getattr(loader.batch_sampler, "sampler", None), data_pass)
    if loader.batch_sampler is not None:
        batching: dict[str, Any] = {
            "batch_size": 1,
            "batch_sampler": _Skipped(loader.batch_sampler, consumed),
        }
    else:  # batch_size=None: every index the sampler yields is one batch of one sample
        batching = {"batch_size": None, "sampler": _Skipped(loader.sampler, consumed)}
    return DataLoader(
        loader.dataset,
        **batching,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


@runtime_checkable
class StatefulLoader(Protocol):
    """A loader that can say where it stands and be put back there (torchdata's
    ``StatefulDataLoader``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _stateful(loader: object) -> StatefulLoader:
    if isinstance(loader, StatefulLoader):
        return loader
    raise ConfigError(
        f"a {type(loader).__name__} cannot say where it stands in its data: it has no "
        "state_dict() and load_state_dict(). For a stream (an IterableDataset), use torchdata's "
        "StatefulDataLoader (pip install torchdata; from torchdata.stateful_dataloader import "
        "StatefulDataLoader), a drop-in DataLoader that has them; for a map-style dataset, use "
        "epochal's PassSampler, or skip_consumed() over this loader"
    )


def stream_position(loader: object) -> dict[str, Any]:
    """Where ``loader`` stands, as its ``state_dict()``.

    Take it after the last batch trained on and before the next is drawn: a
    ``StatefulDataLoader`` counts the batches it handed out, not those its workers prefetched.
    """
    return _stateful(loader).state_dict()


def set_stream_position(loader: object, state: Mapping[str, Any]) -> None:
    """Put ``loader`` back where :func:`stream_position` said it stood (before iterating it)."""
    _stateful(loader).load_state_dict(dict(state))
