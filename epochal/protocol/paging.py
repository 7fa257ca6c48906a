"""A model's parameter list in pages that each fit a frame.

A hello carries only its model's digest (:class:`~epochal.protocol.messages.Fingerprint`). When
the coordinator needs the entries themselves (to name how two workers' models differ, or to
record the run's model in its run directory) it asks for them a page at a time
(:class:`~epochal.protocol.messages.DescribeModel`); :func:`model_page` makes the
:class:`~epochal.protocol.messages.ModelPage` that answers, as many entries as fit in
:data:`PAGE_BYTES`, so that every frame stays within the size limit whatever the model.
:func:`entry` makes an entry any page can carry.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_NAME_CHARS,
    MAX_PAGE_PARAMS,
    ModelPage,
    ParamSpec,
    clip,
)

PAGE_BYTES = MAX_FRAME_BYTES - 1024
"""Bytes the entries of one page may take; the rest of the frame holds its other fields and the
session."""


def entry(name: str, shape: Sequence[int], dtype: str) -> ParamSpec:
    """One entry of a page; a name or dtype longer than MAX_NAME_CHARS is cut, marking the cut
    (the fingerprint's digest covers it whole, so a difference there is still seen)."""
    return ParamSpec(
        name=clip(name, MAX_NAME_CHARS),
        shape=tuple(int(d) for d in shape),
        dtype=clip(dtype, MAX_NAME_CHARS),
    )


def _size(param: ParamSpec) -> int:
    """Bytes ``param`` takes in a frame."""
    packed: bytes = msgpack.packb(
        {"name": param.name, "shape": list(param.shape), "dtype": param.dtype},
        use_bin_type=True,
    )
    return len(packed)


def model_page(params: Sequence[ParamSpec], first: int) -> ModelPage:
    """The page of ``params`` that starts at entry ``first``: one entry at least (while any is
    left), then as many more as fit in :data:`PAGE_BYTES` and :data:`MAX_PAGE_PARAMS`. A
    ``first`` at the end makes an empty page; one past it is a ValueError."""
    if not 0 <= first <= len(params):
        raise ValueError(f"entry {first} is outside the model's {len(params)} entries")
    end, size = first, 0
    while end < len(params) and end - first < MAX_PAGE_PARAMS:
        size += _size(params[end])
        if end > first and size > PAGE_BYTES:
            break
        end += 1
    return ModelPage(first=first, entries=len(params), params=tuple(params[first:end]))
