"""Mode ``replicated`` (the default): DDP all-reduce, every rank holds and steps the optimizer.

Every rank holds the whole model and optimizer after each step, so rank 0's part of a checkpoint
is the whole (:class:`~epochal.worker.checkpoints.state.WholeOnRoot`): rank 0 writes it while
the next epoch trains.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.protocol import SnapshotScope
from epochal.worker.checkpoints.state import BuffersFromRoot, Stateful, WholeOnRoot
from epochal.worker.strategies.ddp import DdpStrategy
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.strategy import Mode


class Replicated(DdpStrategy):
    """DDP: gradients all-reduced in buckets during backward; every rank steps the optimizer."""

    mode: ClassVar[Mode] = Mode.REPLICATED
    snapshot_scope: ClassVar[SnapshotScope] = SnapshotScope.WHOLE
    optimizer_of_model_only: ClassVar[bool] = False  # steps the optimizer it was given, as is

    @classmethod
    def over_ddp(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        ddp: DistributedDataParallel,
    ) -> Replicated:
        return cls(model, optimizer, ddp, layout, ddp)

    @property
    def mode_state(self) -> Stateful:
        assert self.ddp is not None
        state = BuffersFromRoot(super().mode_state, self.ddp)  # rank 0's buffers first
        return WholeOnRoot(state) if self.layout.group is None else state
