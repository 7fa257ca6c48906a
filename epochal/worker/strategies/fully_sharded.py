"""Mode ``fully_sharded``: FSDP2's ``fully_shard``, parameters, gradients and state all ~1/N.

For models whose parameters do not fit one device. The optimizer passed in is rebuilt over the
sharded parameters; the checkpoint is :class:`~epochal.worker.checkpoints.state.TrainState` over the
DTensors (DCP reshards on load), and :meth:`FullySharded.finish` gathers the whole model back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from epochal.errors import ConfigError
from epochal.worker.strategies.base import Mode, Strategy, constructor_kwargs, groups_by_name
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.options import ModeOptions
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
        # start where DDP starts: rank 0's weights
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

    def snapshot(self) -> dict[str, torch.Tensor]:
        # each rank keeps its own shards: no collective, and no rank ever holds the whole model
        return {
            k: (v.to_local() if is_dtensor(v) else v).detach().to("cpu", copy=True)
            for k, v in self.model.state_dict().items()
        }

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                (v.to_local() if is_dtensor(v) else v).copy_(snapshot[k])
