"""Initial parameters computed from data on one rank, given to every rank exactly.

Some models start from parameters that depend on the data: the seed's example is a layer whose
weights are k-means centroids of the inputs. Computing them on every rank would give every rank
different centroids (each sees its own shard); the run needs one set, computed once. So the
computation runs on one rank (``src``, rank 0 by default) and :func:`initialize_on_rank` then
broadcasts every parameter and buffer of the module from that rank through the data plane
(``torch.distributed.broadcast``, in flat buckets). Afterwards every rank holds ``src``'s tensors
bit for bit.

Why a broadcast and not the seed's trick. The seed got the centroids ``c`` to every rank by
training: rank 0 took the loss ``world_size * ((p - c) ** 2).sum()``, the other ranks a loss of
zero, DDP averaged the gradients (``2 * (p - c)``) and one SGD step with ``lr = 0.5`` gave
``p - 0.5 * 2 * (p - c) = c``. That works only for plain SGD without momentum or weight decay,
and only when gradients are averaged (burn *sums* them, which would need another scale); with
Adam the step is normalised and lands somewhere else entirely. It leaves momentum buffers, step
counts and Adam moments behind in the optimizer, as if a real step had happened. It is exact only
up to rounding (``p - (p - c)`` is not always ``c`` in floating point), it cannot set buffers or
parameters that take no gradient, and it costs a forward, a backward and a gradient all-reduce.
A broadcast is exact for any optimizer, touches no optimizer state, sets buffers too, and costs
one transfer of the parameters. ``tests/worker/test_initialization.py`` checks that the trick
and the broadcast reach the same parameters where the trick applies.

If the computation raises on ``src``, every rank learns it through the same collective (a status
broadcast before the tensors): ``src`` re-raises its error, the others raise an
:class:`~epochal.errors.EpochalError` that points at ``src``; nobody waits in a broadcast that
will never come.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from itertools import chain

import torch
import torch.distributed as dist

from epochal.errors import ConfigError, EpochalError

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Tensors are broadcast in flat buckets of about this size (DDP's default bucket size)."""


def buckets(
    tensors: Iterable[torch.Tensor], cap_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[list[torch.Tensor]]:
    """Group ``tensors`` into lists of one device and dtype of at most ``cap_bytes`` each.

    A tensor larger than the cap gets a bucket of its own. The order is kept within each
    (device, dtype), so every rank forms the same buckets from the same module.
    """
    out: list[list[torch.Tensor]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        size = t.numel() * t.element_size()
        current, used = open_bucket.get(key, ([], 0))
        if current and used + size > cap_bytes:
            out.append(current)
            current, used = [], 0
        current.append(t)
        open_bucket[key] = (current, used + size)
    out.extend(bucket for bucket, _ in open_bucket.values() if bucket)
    return out


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    cap_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Overwrite ``tensors`` in place on every rank with global rank ``src``'s values.

    Collective: every rank of ``group`` passes tensors of the same shapes, dtypes and order.
    """
    me = dist.get_rank()
    with torch.no_grad():
        for bucket in buckets(tensors, cap_bytes):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                dist.broadcast(bucket[0], src=src, group=group)
                continue
            if me == src:
                flat = torch.cat([t.reshape(-1) for t in bucket])
            else:
                flat = torch.empty(
                    sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device
                )
            dist.broadcast(flat, src=src, group=group)
            if me != src:
                offset = 0
                for t in bucket:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (~1 s)."""
    loaded = sys.modules.get("torch.distributed.tensor")
    return loaded is not None and isinstance(t, loaded.DTensor)


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module``, in registration order, each once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for _, t in chain(
        module.named_parameters(remove_duplicate=True), module.named_buffers(remove_duplicate=True)
    ):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if is_dtensor(t):
            raise ConfigError(
                "this module's parameters are already sharded (FSDP2 DTensors): broadcast or "
                "initialise it before it is fully sharded (fit does so before it wraps the model)"
            )
        out.append(t)
    return out


def broadcast_module(
    module: torch.nn.Module, *, src: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """Give every rank global rank ``src``'s parameters and buffers, exactly. Collective."""
    broadcast_tensors(module_tensors(module), src=src, group=group)


def initialize_on_rank(
    module: torch.nn.Module,
    compute: Callable[[torch.nn.Module], None],
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Run ``compute(module)`` on global rank ``src`` only, then give its result to every rank.

    ``compute`` sets parameters or buffers of ``module`` in place (it runs under
    ``torch.no_grad()``), e.g. copying k-means centroids of rank ``src``'s data into a layer's
    weight. Collective: every rank of ``group`` calls it, with modules of the same structure. Call
    it before the model is wrapped for training (``fit(..., initialize=compute)`` does that), so
    the optimizer starts from the broadcast parameters with no state of its own.
    """
    me = dist.get_rank()
    failure: BaseException | None = None
    if me == src:
        try:
            with torch.no_grad():
                compute(module)
        except Exception as exc:
            failure = exc
    tensors = module_tensors(module)
    status = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
    if tensors and tensors[0].device.type == "cuda":
        status = status.to(tensors[0].device)  # NCCL moves only CUDA tensors
    dist.broadcast(status, src=src, group=group)
    if failure is not None:
        raise failure
    if int(status.item()) != 0:
        raise EpochalError(
            f"the initialisation on rank {src} raised, so there are no initial parameters to "
            f"receive: see rank {src}'s error"
        )
    broadcast_tensors(tensors, src=src, group=group)
