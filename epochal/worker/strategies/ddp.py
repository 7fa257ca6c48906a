"""What the two DDP modes share: building the DistributedDataParallel wrapper, and again each epoch.

:class:`DdpStrategy` is the base of :class:`~epochal.worker.strategies.replicated.Replicated` and
:class:`~epochal.worker.strategies.sharded.Sharded`: it turns the mode options and the user's
``ddp_options`` into one DDP wrapper, and keeps a factory for the fresh reducer
:meth:`Strategy.begin_epoch` builds every epoch.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.worker.strategies.base import Strategy
from epochal.worker.strategies.options import ModeOptions


class DdpStrategy(Strategy):
    """A mode whose gradients DDP all-reduces (averages) in buckets, overlapped with backward."""

    options: ClassVar[frozenset[str]] = frozenset(
        {"bucket_cap_mb", "find_unused_parameters", "sync_batchnorm"}
    )
    uses_ddp: ClassVar[bool] = True

    @classmethod
    def build(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        opts: ModeOptions,
        ddp_options: dict[str, Any],
        group: dist.ProcessGroup | None,
        *,
        placed: bool,
    ) -> Strategy:
        extra = dict(ddp_options)
        if opts.bucket_cap_mb is not None:
            extra["bucket_cap_mb"] = opts.bucket_cap_mb
        if opts.find_unused_parameters:
            extra["find_unused_parameters"] = True
        one_cuda = device.type == "cuda" and not placed  # DDP takes no device_ids for several
        device_ids = [device] if one_cuda else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group, **extra)
        strategy = cls.over_ddp(model, optimizer, ddp, group)
        strategy._fresh_ddp = lambda: DistributedDataParallel(
            model, device_ids=device_ids, process_group=group, init_sync=False, **extra
        )
        return strategy

    @classmethod
    def over_ddp(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ddp: DistributedDataParallel,
        group: dist.ProcessGroup | None,
    ) -> DdpStrategy:
        """This mode around the DDP wrapper :meth:`build` made."""
        raise NotImplementedError(f"{cls.__name__} does not say how to use its DDP wrapper")
