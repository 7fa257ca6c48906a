"""A model's fingerprint: each parameter's and buffer's name, shape and dtype, and torch's version.

Workers send it in their hello; the coordinator refuses a run whose workers built different models,
naming the first parameter that differs.
"""

from __future__ import annotations

import hashlib

import torch

from epochal.protocol import Fingerprint, ParamSpec


def fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Fingerprint ``model``'s state (parameters and persistent buffers) and the torch version."""
    params = tuple(
        ParamSpec(
            name=name,
            shape=tuple(int(d) for d in t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
        )
        for name, t in model.state_dict().items()
    )
    h = hashlib.sha256(torch.__version__.encode())
    for p in params:
        h.update(f"\0{p.name}\0{p.shape}\0{p.dtype}".encode())
    return Fingerprint(digest=h.hexdigest(), params=params, torch_version=torch.__version__)
