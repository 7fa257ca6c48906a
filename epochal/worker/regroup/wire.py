"""A state dict sent from one rank to all over the data plane: its structure as JSON, its tensors
by broadcast, a bounded amount of them at a time.

:func:`broadcast_tree` sends a nested structure of dicts, lists, tuples, tensors, numbers, strings,
booleans and None (a model's, an optimizer's or a loss scaler's state) from rank ``src`` to every
rank of a group. The structure travels as JSON bytes in which each tensor is its index, shape and
dtype; then the tensors travel in flat buckets (:func:`~epochal.worker.training.initialization.
broadcast_tensors`), one chunk of about ``cap_bytes`` at a time, into tensors the receivers
allocate from those shapes. A ``keep`` function may turn each tensor, as it arrives, into what
this rank holds of it (its shard, a copy on the CPU, or None: nothing), so no rank ever needs
memory for more than what it keeps plus one chunk. Nobody unpickles what a peer sent (torch's
``broadcast_object_list`` and ZeRO's ``consolidate_state_dict`` would). A source that has nothing
to send says so in the same collective, so its peers raise instead of waiting for tensors that
never come.

A receiver allocates nothing a peer's numbers alone decide: every rank passes what it
:class:`Expects`, drawn from its own model (the names and shapes of its entries), and the
structure's length, each tensor's place and shape, and the bytes of them all are checked against
it before anything is allocated. A peer that sends more is refused, by rank, with what was wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from epochal.errors import EpochalError
from epochal.worker.training.initialization import DEFAULT_BUCKET_BYTES, broadcast_tensors

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

Keep = Callable[[tuple[Any, ...], torch.Tensor], Any]
"""What a rank keeps of one tensor of the tree, given its path (the keys and indices that lead to
it) and the tensor (on the communication device; the receiver's own, the sender's may be its
live one): the value the returned tree holds in its place."""


@dataclass(frozen=True, slots=True)
class Slot:
    """A tensor's place in a decoded structure, before its values arrive."""

    index: int
    # its position among the structure's tensors (the order they travel in)
    shape: tuple[int, ...]
    dtype: torch.dtype
    path: tuple[Any, ...]
    # the keys and indices that lead to it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


OPTIMIZER_COPIES = 4
"""Tensors the size of a parameter an optimizer's state may hold for it (Adam keeps two, with
amsgrad three), for :attr:`Expects.tensor_bytes`."""

ELEMENT_BYTES = 8
"""Bytes allowed per element of the model and of its optimizer state, for the same bound (a
float64 model; a narrower one is allowed as much, a wider one its own width)."""

STRUCTURE_FLOOR = 1 << 20
"""Bytes of structure allowed beyond what the model's entries account for (hyperparameters, the
loss scaler's state)."""

STRUCTURE_PER_ENTRY = 16
"""Times each model entry's name (and a tensor's description, 64 bytes) may appear in a
structure: as a model entry, an optimizer state's key, a parameter group's member, with the keys
of its optimizer state."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Expects:
    """What a rank accepts of a structure a peer sends, drawn from its own model: the tensors
    it expects where, and how many bytes of structure and of tensors at most. Built by
    :meth:`of_model`."""

    shapes: Mapping[str, tuple[int, ...]]
    # this rank's model entries by name (its state dict's, and DCP's names for them)
    entries: tuple[tuple[Any, ...], ...] = ()
    # where the model's entries are (``("model",)``: under ``tree["model"][name]``), each the
    # shape of this rank's entry of that name
    optim: tuple[tuple[Any, ...], ...] = ()
    # where an optimizer state is, by parameter name then key (``("optim", "state")``): each
    # tensor at most as many elements as the parameter
    scalars: tuple[tuple[Any, ...], ...] = ()
    # where tensors of at most one element may be, at any depth (parameter groups, the scaler)
    structure_bytes: int
    # the longest structure accepted
    tensor_bytes: int
    # the most bytes of tensors accepted in all

    @classmethod
    def of_model(
        cls,
        model: Mapping[str, torch.Tensor],
        *,
        entries: tuple[tuple[Any, ...], ...] = (),
        optim: tuple[tuple[Any, ...], ...] = (),
        scalars: tuple[tuple[Any, ...], ...] = (),
    ) -> Expects:
        """The bounds for a rank whose model state is ``model`` (its entries by name; a DTensor
        counts whole): structure bytes :data:`STRUCTURE_FLOOR` plus :data:`STRUCTURE_PER_ENTRY`
        times each name's and a tensor's description; tensor bytes, for each element of the
        model at :data:`ELEMENT_BYTES` or its own width if wider, once for its entries and
        :data:`OPTIMIZER_COPIES` times for an optimizer state, plus the structure's length where
        single values may be (a one-element tensor takes more bytes to describe than to hold)."""
        shapes = {name: tuple(t.shape) for name, t in model.items()}
        names = sum(len(json.dumps(name)) + 64 for name in shapes)
        structure = STRUCTURE_FLOOR + STRUCTURE_PER_ENTRY * names
        held = sum(max(ELEMENT_BYTES, t.element_size()) * t.numel() for t in model.values())
        copies = (1 if entries else 0) + (OPTIMIZER_COPIES if optim else 0)
        tensors = copies * held + (structure if scalars else 0)
        return cls(
            shapes=shapes,
            entries=entries,
            optim=optim,
            scalars=scalars,
            structure_bytes=structure,
            tensor_bytes=tensors,
        )

    def refuse(self, slot: Slot) -> str | None:
        """Why ``slot`` is not what this rank's model holds there; None: it is."""
        path, numel = slot.path, math.prod(slot.shape)
        where = "/".join(str(p) for p in path) or "the top"
        for at in self.entries:
            if path[: len(at)] == at and len(path) == len(at) + 1:
                name = path[-1]
                if name not in self.shapes:
                    return f"a tensor {where}, an entry this rank's model does not have"
                if slot.shape != self.shapes[name]:
                    return (
                        f"{where} of shape {list(slot.shape)}, where this rank's model has "
                        f"{list(self.shapes[name])}"
                    )
                return None
        for at in self.optim:
            if path[: len(at)] == at and len(path) >= len(at) + 2:
                name = path[len(at)]
                if name not in self.shapes:
                    return (
                        f"optimizer state {where} for a parameter this rank's model does not have"
                    )
                most = max(1, math.prod(self.shapes[name]))
                if numel > most:
                    return (
                        f"optimizer state {where} of shape {list(slot.shape)} ({numel} elements) "
                        f"for a parameter of {most}"
                    )
                return None
        for at in self.scalars:
            if path[: len(at)] == at and numel <= 1:
                return None
        return f"a tensor {where} of shape {list(slot.shape)}, where this rank expects none"

    def check(self, slots: list[Slot], src: int) -> None:
        """Raise EpochalError naming rank ``src`` and the first tensor of ``slots`` this rank's
        model does not hold, or their total when it is more than it could."""
        total = 0
        for slot in slots:
            why = self.refuse(slot)
            if why is not None:
                raise _refused(src, why)
            total += slot.nbytes
        if total > self.tensor_bytes:
            raise _refused(
                src,
                f"{total} bytes of tensors, where this rank's model holds at most "
                f"{self.tensor_bytes}",
            )

    def check_length(self, length: int, src: int) -> None:
        if not 0 <= length <= self.structure_bytes:
            raise _refused(
                src,
                f"a structure of {length} bytes, where this rank's model needs at most "
                f"{self.structure_bytes}",
            )


def _refused(src: int, what: str) -> EpochalError:
    return EpochalError(
        f"rank {src} sent a state this rank's model cannot hold: {what}. Refused before "
        "anything was allocated; every rank of a run must build the same model"
    )


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
            bad = [k for k in value if not (k is None or isinstance(k, bool | int | str | float))]
            if bad:
                raise EpochalError(f"{path} has a key of type {type(bad[0]).__name__}")
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


def decode(data: bytes) -> tuple[Any, list[Slot]]:
    """The structure :func:`encode` made, with a :class:`Slot` in each tensor's place, and the
    slots in order. Nothing is allocated. Malformed bytes raise EpochalError."""
    slots: list[Slot] = []

    def bad(what: str) -> EpochalError:
        return EpochalError(f"the state a peer sent is malformed: {what}")

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if value is None or isinstance(value, bool | int | str | float):
            return value
        if not (isinstance(value, dict) and len(value) == 1):
            raise bad(f"unexpected {type(value).__name__}")
        ((kind, body),) = value.items()
        if kind == "tensor":
            if not (isinstance(body, list) and len(body) == 3):
                raise bad("a tensor is not [index, shape, dtype]")
            index, shape, name = body
            if index != len(slots) or name not in _DTYPES:
                raise bad(f"tensor {index!r} of dtype {name!r}")
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise bad(f"tensor {index} has shape {shape!r}")
            slots.append(Slot(index, tuple(shape), _DTYPES[name], path))
            return slots[-1]
        if kind == "float" and body in ("inf", "-inf", "nan"):
            return float(body)
        if not isinstance(body, list):
            raise bad(f"{kind} is not a list")
        if kind == "dict":
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in body):
                raise bad("a dict entry is not a [key, value] pair")
            out = {}
            for k, v in body:
                key = walk(k, path)
                if isinstance(key, Slot | dict | list | tuple):
                    raise bad("a dict key is not a plain value")
                out[key] = walk(v, (*path, key))
            return out
        if kind in ("list", "tuple"):
            items = [walk(v, (*path, i)) for i, v in enumerate(body)]
            return items if kind == "list" else tuple(items)
        raise bad(f"unknown kind {kind!r}")

    try:
        tree = walk(json.loads(data), ())
    except (ValueError, TypeError, RecursionError) as exc:
        raise bad(str(exc)) from None
    return tree, slots


def _fill(tree: Any, values: dict[int, Any]) -> Any:
    """``tree`` with each slot replaced by its value."""
    if isinstance(tree, Slot):
        return values[tree.index]
    if isinstance(tree, dict):
        return {k: _fill(v, values) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_fill(v, values) for v in tree)
    return tree


def _chunks(slots: list[Slot], cap_bytes: int) -> list[list[Slot]]:
    """``slots`` in order, cut into runs of at most ``cap_bytes`` (a larger tensor alone): the
    same cut on every rank, which all decoded the same bytes."""
    out: list[list[Slot]] = []
    used = 0
    for slot in slots:
        if not out or (out[-1] and used + slot.nbytes > cap_bytes):
            out.append([])
            used = 0
        out[-1].append(slot)
        used += slot.nbytes
    return out


def broadcast_tree(
    tree: Any,
    *,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    expects: Expects,
    keep: Keep | None = None,
    cap_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[Any, int]:
    """Give every rank of ``group`` global rank ``src``'s ``tree``; return it and the bytes it
    took (structure and tensors). Collective.

    Without ``keep`` the source gets its ``tree`` back as given and the others a copy on
    ``device``; with it every rank, the source included, gets the structure with what ``keep``
    returned for each tensor. None as the source's ``tree`` means it has nothing to send: it gets
    None back and every other rank raises EpochalError. ``device`` is where the backend
    communicates (the CPU for gloo, this rank's GPU for NCCL); ``cap_bytes`` bounds the tensors in
    flight at once (beyond the largest one). ``expects`` is what a receiving rank accepts, from
    its own model: a structure longer, or a tensor it does not hold where it was sent, makes it
    raise EpochalError before it allocates any (the source then waits in the collective until
    its timeout, as for any rank that left).
    """
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
    if me != src:
        expects.check_length(length, src)
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if me == src
        else torch.empty(length, dtype=torch.uint8, device=device)
    )
    dist.broadcast(buffer, src=src, group=group)
    skeleton, slots = decode(data if me == src else bytes(buffer.cpu().numpy()))
    if me != src:
        expects.check(slots, src)
    values: dict[int, Any] = {}
    for chunk in _chunks(slots, cap_bytes):
        if me == src:
            moving = [tensors[s.index].detach().to(device) for s in chunk]
        else:
            moving = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in chunk]
        broadcast_tensors(moving, src=src, group=group, cap_bytes=cap_bytes)
        if me == src and keep is None:
            continue  # it returns its own tree: nothing of the copies stays
        for slot, tensor in zip(chunk, moving, strict=True):
            values[slot.index] = tensor if keep is None else keep(slot.path, tensor)
    moved = length + sum(s.nbytes for s in slots)
    if me == src and keep is None:
        return tree, moved
    return _fill(skeleton, values), moved
