"""A model's fingerprint: each parameter's and buffer's name, shape and dtype, and torch's version.

A worker's hello carries the :class:`~epochal.protocol.Fingerprint` alone: a digest of them all,
the torch version and how many entries there are. The entries themselves stay with the worker
(:class:`Described`), which sends them a page at a time when the coordinator asks
(:class:`~epochal.protocol.DescribeModel`): to name the first parameter that differs between two
workers' models, or to record the run's model in its run directory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from epochal.protocol import Fingerprint, ParamSpec
from epochal.protocol.paging import entry


@dataclass(frozen=True, slots=True)
class Described:
    """A model as a worker describes it: the fingerprint its hello carries and the entries it
    sends when asked."""

    fingerprint: Fingerprint
    params: tuple[ParamSpec, ...]


def describe(model: torch.nn.Module) -> Described:
    """Describe ``model``'s state (parameters and persistent buffers) and the torch version.

    The digest covers every name whole; an entry's name longer than a page can carry is cut in
    the entries sent (:func:`~epochal.protocol.paging.entry`)."""
    h = hashlib.sha256(torch.__version__.encode())
    params = []
    for name, t in model.state_dict().items():
        shape = tuple(int(d) for d in t.shape)
        dtype = str(t.dtype).removeprefix("torch.")
        h.update(f"\0{name}\0{shape}\0{dtype}".encode())
        params.append(entry(name, shape, dtype))
    fingerprint = Fingerprint(
        digest=h.hexdigest(), torch_version=torch.__version__, entries=len(params)
    )
    return Described(fingerprint, tuple(params))


def fingerprint(model: torch.nn.Module) -> Fingerprint:
    """The fingerprint of ``model``'s state and the torch version (see :func:`describe`)."""
    return describe(model).fingerprint
