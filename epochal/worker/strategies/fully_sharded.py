"""Mode ``fully_sharded``: FSDP2's ``fully_shard``, parameters, gradients and state all ~1/N.

For models whose parameters do not fit one device. The optimizer passed in is rebuilt over the
sharded parameters; the checkpoint is :class:`~epochal.worker.checkpoints.state.TrainState` over the
DTensors (DCP reshards on load), and :meth:`FullySharded.finish` gathers the whole model back.

A world that changes size shards the same module object again: :meth:`FullySharded.release_group`
turns its parameters into plain ones on the meta device (no rank can gather them once a peer is
lost), and the next build over the new group shards that module and gives each rank empty shards,
whose values are then loaded (the last checkpoint, or :func:`epochal.worker.regroup.share`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from epochal.errors import ConfigError
from epochal.protocol import SnapshotScope
from epochal.worker.dataplane import torchinternals
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.modeoptions import ModeOptions
from epochal.worker.strategies.strategy import (
    Mode,
    Strategy,
    constructor_kwargs,
    copy_state,
    groups_by_name,
)
from epochal.worker.training.initialization import broadcast_module, broadcast_tensors, is_dtensor
from epochal.worker.training.placement import LayeredModel


def _default_units(model: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                visit(child)  # containers have no forward of their own to hook
            elif any(True for _ in child.parameters()):
                units.append(child)

    visit(model)
    return units


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _values_everywhere(model: nn.Module, layout: Layout) -> bool:
    """Whether every rank's model has values: not when one was rebuilt after leaving a group
    (meta parameters, :meth:`FullySharded.release_group`). Collective, so that every rank skips
    the broadcast of rank 0's weights alike when one has none (a newcomer's are real)."""
    flag = torch.tensor([1 if _on_meta(model) else 0], dtype=torch.int32, device=layout.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=layout.group)
    return int(flag.item()) == 0


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give the meta shards of a sharded ``model`` memory on ``device`` (no values), keeping the
    buffers it holds: FSDP2 shards parameters only, so buffers never went to meta."""
    kept = [(module, dict(module._buffers)) for module in model.modules()]
    model.to_empty(device=device)
    for module, buffers in kept:
        module._buffers.update(buffers)


class FullySharded(Strategy):
    """FSDP2: ``fully_shard`` on each unit and the root; parameters, gradients and optimizer
    state are each split across ranks (the optimizer is rebuilt over the sharded parameters).

    While it trains, the model's parameters are this rank's DTensor shards. When training ends
    (:meth:`finish`) every rank gathers the whole model and the model becomes the plain module it
    was (:func:`epochal.worker.training.unshard.unshard`), so ``model`` holds full weights after
    ``train()`` returns, as in the other modes. The checkpoints hold it sharded (DCP reshards on
    load).
    """

    mode: ClassVar[Mode] = Mode.FULLY_SHARDED
    snapshot_scope: ClassVar[SnapshotScope] = SnapshotScope.SHARD
    options: ClassVar[frozenset[str]] = frozenset({"reshard_after_forward", "shard_units"})

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        opts: ModeOptions,
    ) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard

        groups = groups_by_name(model, optimizer)
        # start where DDP starts: rank 0's weights; unless a rank has none (rebuilt after a
        # regroup): every rank then loads its values after the build
        if _values_everywhere(model, layout):
            broadcast_module(model, src=layout.root, group=layout.group)
        kind = layout.device.type
        mesh = (
            init_device_mesh(kind, (layout.world_size,))
            if layout.group is None
            else DeviceMesh.from_group(layout.group, kind)
        )
        units = list(
            opts.shard_units(model) if opts.shard_units is not None else _default_units(model)
        )
        for unit in [*units, model]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=opts.reshard_after_forward)
        # DTensor's caches keep the mesh for the life of the process: release_group makes it
        # drop the group, or the group would stay open after it is destroyed
        self._mesh: DeviceMesh | None = mesh
        if _on_meta(model):
            _materialize(model, layout.device)
        params = dict(model.named_parameters())
        try:
            rebuilt = type(optimizer)(
                [{**hyper, "params": [params[n] for n in names]} for hyper, names in groups],
                **constructor_kwargs(optimizer),
            )
        except TypeError as exc:
            raise ConfigError(
                f"cannot rebuild {type(optimizer).__name__} over the sharded parameters: {exc}"
            ) from None
        super().__init__(model, rebuilt, model, layout)
        self._buffers = list(model.buffers())  # FSDP2 leaves buffers whole and unsynchronised

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        if isinstance(model, LayeredModel) and len(model.devices) > 1:
            raise ConfigError(
                "a model placed over several devices cannot be fully sharded (one FSDP2 mesh has "
                "one device type and index per rank): use mode replicated, main or sharded with it"
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
        return cls(model, optimizer, layout, opts)

    def step(self) -> None:
        # the gradients are DTensor shards: clip_grad_norm_ reduces their norm across ranks, and
        # the scaler's inf check is reduced too, so every rank clips and skips alike
        self.policy.step(self.optimizer)
        # DDP broadcasts rank 0's buffers (BatchNorm statistics); so does every mode here
        broadcast_tensors(self._buffers, src=self.layout.root, group=self.layout.group)

    @contextmanager
    def _no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def no_sync(self) -> AbstractContextManager[Any]:
        return self._no_sync()

    def finish(self) -> None:
        from epochal.worker.training.unshard import unshard

        unshard(self.model)
        self._release_mesh()  # the model is whole and plain: the group may close when destroyed

    def _release_mesh(self) -> None:
        if self._mesh is not None:
            torchinternals.release_mesh(self._mesh)
            self._mesh = None

    def release_group(self) -> None:
        """The parameters are DTensors over the group's mesh, and the optimizer holds them: the
        model becomes a plain module again, its parameters on the meta device (their values went
        with the shards), with an optimizer of the same class and groups over them, no state."""
        from epochal.worker.training.unshard import drop_shards

        if not self.released:
            groups = groups_by_name(self.model, self.optimizer)
            kind, kwargs = type(self.optimizer), constructor_kwargs(self.optimizer)
            self.optimizer.state.clear()
            drop_shards(self.model)
            self._release_mesh()
            params = dict(self.model.named_parameters())
            self.optimizer = kind(
                [{**hyper, "params": [params[n] for n in names]} for hyper, names in groups],
                **kwargs,
            )
        super().release_group()

    def snapshot(self, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        # each rank keeps its own shards: no collective, and no rank ever holds the whole model
        local = {
            k: v.to_local() if is_dtensor(v) else v for k, v in self.model.state_dict().items()
        }
        return copy_state(local, into)

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                (v.to_local() if is_dtensor(v) else v).copy_(snapshot[k])
