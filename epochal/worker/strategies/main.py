"""Mode ``main``: gradients reduced onto rank 0, which alone holds optimizer state and steps.

burn's ``OptimMainDevice``, lamp's root optimizer. No DDP: the gradients travel in buckets when
the step comes, and the new parameters are broadcast back; the checkpoint is
:class:`~epochal.worker.checkpoints.state.MainState` (every rank's model, rank 0's optimizer).
Every rank holds rank 0's parameters and buffers after each step, and rank 0 alone the optimizer,
so rank 0's part is the whole (:class:`~epochal.worker.checkpoints.state.WholeOnRoot`): rank 0
writes it while the next epoch trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from epochal.protocol import SnapshotScope
from epochal.worker.checkpoints.state import MainState, Stateful, WholeOnRoot
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.modeoptions import ModeOptions
from epochal.worker.strategies.strategy import Mode, Strategy, state_bytes
from epochal.worker.training.initialization import (
    DEFAULT_BUCKET_BYTES,
    broadcast_tensors,
    buckets,
    module_tensors,
)


class Main(Strategy):
    """Gradients averaged onto rank 0, which alone holds optimizer state and steps; parameters
    are broadcast back. Communication happens in :meth:`step`, so accumulation needs no
    ``no_sync`` and the batches before a step exchange nothing."""

    mode: ClassVar[Mode] = Mode.MAIN
    snapshot_scope: ClassVar[SnapshotScope] = SnapshotScope.ROOT
    options: ClassVar[frozenset[str]] = frozenset(
        {"bucket_cap_mb", "find_unused_parameters", "sync_batchnorm"}
    )

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        *,
        bucket_bytes: int,
        find_unused_parameters: bool,
    ) -> None:
        super().__init__(model, optimizer, model, layout)
        self._find_unused = find_unused_parameters
        self._bucket_bytes = bucket_bytes
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buckets = buckets(self._params, bucket_bytes)
        self._tensors = module_tensors(model)
        broadcast_tensors(
            self._tensors, src=layout.root, group=layout.group, cap_bytes=bucket_bytes
        )

    @classmethod
    def build(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        opts: ModeOptions,
        ddp_options: Mapping[str, Any],
    ) -> Strategy:
        cap = opts.bucket_cap_mb
        return cls(
            model,
            optimizer,
            layout,
            bucket_bytes=DEFAULT_BUCKET_BYTES if cap is None else int(cap * 1024 * 1024),
            find_unused_parameters=opts.find_unused_parameters,
        )

    @property
    def is_root(self) -> bool:
        """Whether this rank holds the optimizer and steps (the layout's rank 0)."""
        return self.layout.is_root

    @property
    def mode_state(self) -> Stateful:
        state = MainState(self.model, self.optimizer, self.is_root)
        return WholeOnRoot(state) if self.layout.group is None else state

    def step(self) -> None:
        layout = self.layout
        used: dict[int, bool] | None = None
        if self._find_unused:
            mask = torch.tensor(
                [p.grad is not None for p in self._params],
                dtype=torch.int32,
                device=self._params[0].device if self._params else None,
            )
            dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=layout.group)
            used = {id(p): bool(m) for p, m in zip(self._params, mask.tolist(), strict=True)}
        with torch.no_grad():
            for bucket in self._buckets:
                flat = torch.cat(
                    [
                        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                        for p in bucket
                    ]
                )
                flat.div_(layout.world_size)  # DDP's order: divide, then sum
                dist.reduce(flat, dst=layout.root, op=dist.ReduceOp.SUM, group=layout.group)
                if not self.is_root:
                    continue
                offset = 0
                for p in bucket:
                    piece = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if used is not None and not used[id(p)]:
                        p.grad = None
                    elif p.grad is None:
                        p.grad = piece.clone()
                    else:
                        p.grad.copy_(piece)
        if self.is_root:  # rank 0 alone holds the averaged gradients: it unscales and clips
            self.policy.step(self.optimizer)
        broadcast_tensors(
            self._tensors, src=layout.root, group=layout.group, cap_bytes=self._bucket_bytes
        )
        if self._tensors:  # fp16: rank 0 alone saw whether the step overflowed
            self.policy.share_scale(layout.root, layout.group, self._tensors[0].device)

    def optimizer_state_bytes(self) -> int:
        return state_bytes(self.optimizer) if self.is_root else 0
