"""What the two DDP modes share: building the DistributedDataParallel wrapper, and again each epoch.

:class:`DdpStrategy` is the base of :class:`~epochal.worker.strategies.replicated.Replicated` and
:class:`~epochal.worker.strategies.sharded.Sharded`: it turns the mode options and the user's
``ddp_options`` into one DDP wrapper over the layout's group, and keeps a factory for the fresh
reducer :meth:`Strategy.begin_epoch` builds every epoch (over the strategy's layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.modeoptions import ModeOptions
from epochal.worker.strategies.strategy import Strategy


def ddp_over(
    model: nn.Module, layout: Layout, extra: Mapping[str, Any], *, init_sync: bool = True
) -> DistributedDataParallel:
    """DDP around ``model`` over the layout's group; ``init_sync``: broadcast rank 0's weights."""
    one_cuda = layout.device.type == "cuda" and not layout.placed  # no device_ids for several
    return DistributedDataParallel(
        model,
        device_ids=[layout.device] if one_cuda else None,
        process_group=layout.group,
        init_sync=init_sync,
        **extra,
    )


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
        layout: Layout,
        opts: ModeOptions,
        ddp_options: Mapping[str, Any],
    ) -> Strategy:
        extra = dict(ddp_options)
        if opts.bucket_cap_mb is not None:
            extra["bucket_cap_mb"] = opts.bucket_cap_mb
        if opts.find_unused_parameters:
            extra["find_unused_parameters"] = True
        strategy = cls.over_ddp(model, optimizer, layout, ddp_over(model, layout, extra))
        strategy._fresh_ddp = lambda: ddp_over(model, strategy.layout, extra, init_sync=False)
        return strategy

    @classmethod
    def over_ddp(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        ddp: DistributedDataParallel,
    ) -> DdpStrategy:
        """This mode around the DDP wrapper :meth:`build` made over ``layout``."""
        raise NotImplementedError(f"{cls.__name__} does not say how to use its DDP wrapper")
