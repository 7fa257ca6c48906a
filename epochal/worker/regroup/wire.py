"""A state dict sent from one rank to all over the data plane: its structure as JSON, its tensors
by broadcast.

:func:`broadcast_tree` sends a nested structure of dicts, lists, tuples, tensors, numbers, strings,
booleans and None (a model's, an optimizer's or a loss scaler's state) from rank ``src`` to every
rank of a group. The structure travels as JSON bytes in which each tensor is its index, shape and
dtype; then the tensors travel in flat buckets per dtype (:func:`broadcast_tensors`), into tensors
the receivers allocate from those shapes. Nobody unpickles what a peer sent (torch's
``broadcast_object_list`` would). A source that has nothing to send says so in the same
collective, so its peers raise instead of waiting for tensors that never come.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from epochal.errors import EpochalError
from epochal.worker.training.initialization import broadcast_tensors

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
"""The tensor dtypes a structure may hold, by name."""


def encode(tree: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``tree`` as JSON bytes and the list of its tensors, in the order the bytes name them."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise EpochalError(
                    f"{path} is a tensor of dtype {value.dtype}, which share cannot send"
                )
            tensors.append(value)
            return {"tensor": [len(tensors) - 1, list(value.shape), name]}
        if isinstance(value, dict):
            return {"dict": [[walk(k, path), walk(v, f"{path}.{k}")] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"float": repr(value)}
        raise EpochalError(
            f"{path} holds a {type(value).__name__}: a shared state holds tensors, numbers, "
            "strings, booleans, None, and dicts, lists and tuples of them"
        )

    return json.dumps(walk(tree, "state"), allow_nan=False).encode(), tensors


def decode(data: bytes, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """The structure :func:`encode` made, with new (empty) tensors on ``device`` in its tensors'
    places, and the list of those tensors in order. Malformed bytes raise EpochalError."""
    tensors: list[torch.Tensor] = []

    def bad(what: str) -> EpochalError:
        return EpochalError(f"the state a peer sent is malformed: {what}")

    def walk(value: Any) -> Any:
        if value is None or isinstance(value, bool | int | str | float):
            return value
        if not (isinstance(value, dict) and len(value) == 1):
            raise bad(f"unexpected {type(value).__name__}")
        ((kind, body),) = value.items()
        if kind == "tensor":
            if not (isinstance(body, list) and len(body) == 3):
                raise bad("a tensor is not [index, shape, dtype]")
            index, shape, name = body
            if index != len(tensors) or name not in _DTYPES:
                raise bad(f"tensor {index!r} of dtype {name!r}")
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise bad(f"tensor {index} has shape {shape!r}")
            tensors.append(torch.empty(shape, dtype=_DTYPES[name], device=device))
            return tensors[-1]
        if kind == "float" and body in ("inf", "-inf", "nan"):
            return float(body)
        if not isinstance(body, list):
            raise bad(f"{kind} is not a list")
        if kind == "dict":
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in body):
                raise bad("a dict entry is not a [key, value] pair")
            return {walk(k): walk(v) for k, v in body}
        if kind in ("list", "tuple"):
            items = [walk(v) for v in body]
            return items if kind == "list" else tuple(items)
        raise bad(f"unknown kind {kind!r}")

    try:
        tree = walk(json.loads(data))
    except (ValueError, TypeError, RecursionError) as exc:
        raise bad(str(exc)) from None
    return tree, tensors


def broadcast_tree(
    tree: Any,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[Any, int]:
    """Give every rank of ``group`` global rank ``src``'s ``tree``; return it and the bytes it
    took (structure and tensors). Collective. On ``src`` the tree is returned as given; None
    there means it has nothing to send, and every other rank raises EpochalError. ``device``
    is where the backend communicates (the CPU for gloo, this rank's GPU for NCCL)."""
    me = dist.get_rank()
    data, tensors = b"", list[torch.Tensor]()
    if me == src and tree is not None:
        data, tensors = encode(tree)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    length = int(size.item())
    if length == 0:
        if me == src:
            return None, 0
        raise EpochalError(
            f"rank {src} had no state to share: it must hold the state it sends "
            "(in sharded modes, consolidate() it in the old group first)"
        )
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if me == src
        else torch.empty(length, dtype=torch.uint8, device=device)
    )
    dist.broadcast(buffer, src=src, group=group)
    if me == src:
        moved = [t.detach().to(device) for t in tensors]
        received = tree
    else:
        received, moved = decode(bytes(buffer.cpu().numpy()), device)
    broadcast_tensors(moved, src=src, group=group)
    return received, length + sum(t.numel() * t.element_size() for t in moved)
