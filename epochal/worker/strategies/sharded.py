"""Mode ``sharded``: DDP all-reduce, ``ZeroRedundancyOptimizer`` steps ~1/N of the state per rank.

burn's ``OptimSharded``. The optimizer passed in is rebuilt as ZeRO's local shard optimizer of the
same class, groups and hyperparameters; the checkpoint is
:class:`~epochal.worker.checkpoints.state.ShardedState` (each rank's shard keyed by parameter name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.errors import ConfigError
from epochal.protocol import SnapshotScope
from epochal.worker.checkpoints.state import BuffersFromRoot, ShardedState, Stateful
from epochal.worker.strategies.ddp import DdpStrategy
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.strategy import Mode, constructor_kwargs, state_bytes

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer


class Sharded(DdpStrategy):
    """DDP for gradients, ``ZeroRedundancyOptimizer`` for the step: each rank keeps and steps the
    optimizer state of its share of the parameters, then broadcasts their new values."""

    mode: ClassVar[Mode] = Mode.SHARDED
    snapshot_scope: ClassVar[SnapshotScope] = SnapshotScope.SHARD

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        ddp: DistributedDataParallel,
    ) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
        try:
            zero = ZeroRedundancyOptimizer(
                groups,
                optimizer_class=type(optimizer),
                process_group=layout.group,
                **constructor_kwargs(optimizer),
            )
        except TypeError as exc:
            raise ConfigError(
                f"cannot build a sharded {type(optimizer).__name__}: {exc}; mode 'sharded' builds "
                "the optimizer again from its class and defaults"
            ) from None
        super().__init__(model, zero, ddp, layout, ddp)
        self.zero: ZeroRedundancyOptimizer | None = zero
        # None once the group is released

    @classmethod
    def over_ddp(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        ddp: DistributedDataParallel,
    ) -> Sharded:
        return cls(model, optimizer, layout, ddp)

    @property
    def mode_state(self) -> Stateful:
        assert self.ddp is not None and self.zero is not None
        return BuffersFromRoot(ShardedState(self.model, self.zero), self.ddp)

    def optimizer_state_bytes(self) -> int:
        assert self.zero is not None
        return state_bytes(self.zero.optim)

    def release_group(self) -> None:
        """ZeRO holds the group: keep, in its place, an optimizer of the class it shards (the
        same parameter groups and hyperparameters, no state) for the next build to shard anew."""
        zero = self.zero
        if zero is not None:
            groups = [{**g, "params": list(g["params"])} for g in zero.param_groups]
            self.optimizer = type(zero.optim)(groups, **constructor_kwargs(zero.optim))
            self.zero = None
            del zero
        super().release_group()
