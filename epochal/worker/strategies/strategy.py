"""The interface every optimization mode implements, and the helpers the modes share.

A mode is a subclass of :class:`Strategy` in its own module (``replicated``, ``main``,
``sharded``, ``fully_sharded``) that declares, as class attributes, its name (:class:`Mode`),
the :class:`~epochal.worker.strategies.modeoptions.ModeOptions` fields it has a use for and whether
it uses DistributedDataParallel, and builds itself in :meth:`Strategy.build` from the model, the
optimizer, its options and a :class:`~epochal.worker.strategies.layout.Layout` (device, process
group, rank, world size), which it keeps and reads those from, never from ``torch.distributed``.
:mod:`epochal.worker.strategies.modes` lists the modes and checks a call against those
declarations; nothing else names a mode.

For a world that changes size (:mod:`epochal.worker.regroup`) a mode also declares what one rank's
copy of its state holds (:class:`~epochal.protocol.SnapshotScope`), so whether the survivors of a
lost rank can restore from memory, and drops its hold on a process group it leaves
(:meth:`Strategy.release_group`), keeping what :meth:`Strategy.build` needs to build it again over
the next one.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from enum import StrEnum
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.errors import ConfigError
from epochal.protocol import SnapshotScope
from epochal.worker.checkpoints.asyncsave import host_copy
from epochal.worker.checkpoints.state import ModelState, Stateful, TrainState
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.modeoptions import ModeOptions
from epochal.worker.training.initialization import is_dtensor
from epochal.worker.training.precision import StepPolicy

EXACT_IN_ANY_LAYOUT = 2
"""Ranks up to which DDP's all-reduce gives the same bits whatever its buckets' layout: each
element's sum is one addition (``a + b == b + a`` in floating point), so no fresh reducer is
needed to make an epoch start as the uninterrupted run's did (:meth:`Strategy.begin_epoch`)."""


class Mode(StrEnum):
    """The optimization modes by name (``fit(..., mode=...)`` takes the plain string too)."""

    REPLICATED = "replicated"
    MAIN = "main"
    SHARDED = "sharded"
    FULLY_SHARDED = "fully_sharded"


class Strategy:
    """One mode's way of training ``model`` with ``optimizer``; built by :func:`wrap`."""

    mode: ClassVar[Mode]
    # the mode's name
    snapshot_scope: ClassVar[SnapshotScope]
    # what one rank's copy of the state holds: whether a world that lost ranks restores from
    # memory or from the last checkpoint (SnapshotScope.restore_after)
    options: ClassVar[frozenset[str]] = frozenset()
    # the ModeOptions fields this mode has a use for; the others must keep their defaults
    uses_ddp: ClassVar[bool] = False
    # wraps the model in DistributedDataParallel: takes ddp_options and configure_ddp
    optimizer_of_model_only: ClassVar[bool] = True
    # rebuilds the optimizer or broadcasts the model's tensors, so the optimizer must hold this
    # model's parameters only

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        layout: Layout,
        ddp: DistributedDataParallel | None = None,
    ) -> None:
        self.layout = layout
        # where and among whom it trains: the one place the strategy reads its device, process
        # group, rank and world size from (a strategy for another group is built anew)
        self.model = model
        # the model itself (its BatchNorms synchronised or its parameters sharded as the mode
        # asks); validation and the weights the run returns use it
        self.module = module
        # what the training forward calls: the DDP wrapper, or the model
        self.optimizer = optimizer
        # the optimizer that steps: set the learning rate on its param_groups
        self.ddp = ddp
        # the DDP wrapper in replicated and sharded (for comm hooks), else None
        self.configure: Callable[[DistributedDataParallel], None] | None = None
        # applied to every DDP wrapper this strategy makes (configure_ddp: comm hooks and such)
        self._fresh_ddp: Callable[[], DistributedDataParallel] | None = None
        self._configured: DistributedDataParallel | None = None
        # the DDP wrapper :attr:`configure` was applied to (once: a comm hook is registered once)
        self.policy = StepPolicy()
        # autocast, loss scaling and clipping (train's precision and clip_grad_norm): the loop
        # runs its forward under policy.autocast() and its backward through policy.backward()
        self.opts = ModeOptions()
        # the mode options it was built with (wrap sets them): a rebuild uses them again
        self.ddp_options: dict[str, Any] = {}
        # the further DDP keyword arguments it was built with (wrap sets them)
        self.released = False
        # release_group ran: the strategy holds no process group and cannot train any more

    @classmethod
    def check_model(cls, model: nn.Module) -> None:
        """Refuse a model this mode cannot train, before anything is moved or communicated."""

    @classmethod
    def build(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        opts: ModeOptions,
        ddp_options: Mapping[str, Any],
    ) -> Strategy:
        """This mode over ``model`` (already on ``layout.device``, unless ``layout.placed``),
        among the ranks of ``layout.group``; ``opts`` and ``ddp_options`` already checked against
        the mode's declarations. Collective over the layout's group."""
        raise NotImplementedError(f"{cls.__name__} does not say how to build itself")

    def begin_epoch(self) -> None:
        """Before each training epoch: DDP modes start the epoch with a fresh reducer.

        DDP lays its gradient buckets out anew after the first backward it sees, and the layout
        decides the order in which a bucket's elements are summed across ranks. A run resumed
        after epoch k would run epoch k+1's first step with the initial layout where the
        uninterrupted run used the rebuilt one: with three ranks or more (where float addition
        order matters) the weights then differ in the last bits. A fresh reducer every epoch
        (no parameter broadcast: ``init_sync=False``) makes every epoch start alike, so resume is
        bit-identical at any world size, for the cost of building the reducer once an epoch.

        With one or two ranks an element's sum across ranks is a single addition, which gives the
        same bits in either order: the layout cannot change a result, and the reducer is kept
        (its buckets laid out once), which spares each epoch's first step the work.
        """
        if self._fresh_ddp is None:
            return
        if self.ddp is None or self.layout.world_size > EXACT_IN_ANY_LAYOUT:
            self.ddp = self._fresh_ddp()
            self.module = self.ddp
        elif self.ddp is self._configured:
            return  # kept, and configured when its first epoch began
        if self.configure is not None:
            self.configure(self.ddp)  # before the wrapper's first step: comm hooks and such
        self._configured = self.ddp

    @property
    def mode_state(self) -> Stateful:
        """Model and optimizer, as this mode holds them (a mode overrides this, not ``state``)."""
        return TrainState(self.model, self.optimizer)

    @property
    def state(self) -> Stateful:
        """What a checkpoint holds: :attr:`mode_state`, and with fp16 the loss scaler's state,
        so that a resumed run scales (and skips steps) as the uninterrupted one."""
        return self.policy.checkpointed(self.mode_state)

    @property
    def model_state(self) -> Stateful:
        """The model alone, for a checkpoint's weights."""
        return ModelState(self.model)

    def step(self) -> None:
        """Apply the averaged gradients: every rank ends with the same parameters.

        Unscaling (fp16) and clipping happen here, through :attr:`policy`, on gradients already
        averaged across ranks: DDP's all-reduce ran in the stepping batch's backward.
        """
        self.policy.step(self.optimizer)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> AbstractContextManager[Any]:
        """Around the forward and backward of a batch that only accumulates gradients."""
        return self.ddp.no_sync() if self.ddp is not None else nullcontext()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds."""
        return state_bytes(self.optimizer)

    def finish(self) -> None:
        """When training ends, while the process group lives: leave ``model`` whole on every rank,
        a plain module usable without the group. Collective in modes that shard the model."""

    def release_group(self) -> None:
        """Drop every reference this strategy holds to its process group, so that destroying the
        group closes its sockets. What :meth:`build` needs to build the mode again over another
        group stays: :attr:`model`, an :attr:`optimizer` to build from, :attr:`policy`,
        :attr:`opts`, :attr:`ddp_options` and :attr:`configure`. No communication. A mode that
        holds more (ZeRO, FSDP2) overrides this and calls it."""
        self.ddp = self._configured = None  # a wrapper holds its group
        self.module = self.model
        self._fresh_ddp = None  # its closure reads the layout; a rebuild makes a new one
        if self.layout.group is not None:  # a group of our own: the layout must not keep it
            self.layout = dataclasses.replace(self.layout, group=None, root=0)
        for module in self.model.modules():
            if isinstance(module, nn.SyncBatchNorm):
                module.process_group = None
        self.released = True

    def snapshot(self, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A CPU copy of this rank's model state, for :meth:`restore` (the best epoch's), written
        into ``into`` (the last one) where it fits."""
        return copy_state(self.model.state_dict(), into)

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(snapshot)


def _fits(into: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    """Whether ``into`` holds a tensor of the same shape and dtype for each of ``state``'s."""
    return into.keys() == state.keys() and all(
        into[k].shape == v.shape and into[k].dtype == v.dtype for k, v in state.items()
    )


def copy_state(
    state: dict[str, torch.Tensor], into: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """A CPU copy of ``state``: into the tensors of ``into`` where it holds the same names,
    shapes and dtypes (the last best epoch's copy, whose memory is then reused rather than
    allocated and faulted in again at every best epoch: most of an epoch boundary's own work
    with short epochs, ``bench/cadence.py``), else into new ones."""
    if into is not None and _fits(into, state):
        with torch.no_grad():
            for k, v in state.items():
                into[k].copy_(v)
        return into
    fresh: dict[str, torch.Tensor] = host_copy(state)
    return fresh


def constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its class's constructor accepts (AdamW implies some itself)."""
    signature = inspect.signature(type(optimizer).__init__)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in signature.parameters}


def groups_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[dict[str, Any], list[str]]]:
    """Each parameter group's hyperparameters and parameter names; unknown parameters refused."""
    names = {id(p): name for name, p in model.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ConfigError(
                f"the optimizer holds {len(missing)} parameter(s) the model does not (shapes "
                f"{missing[:3]}): build the optimizer from model.parameters() of this model"
            )
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.append((hyper, [names[id(p)] for p in group["params"]]))
    return out


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the state tensors ``optimizer`` holds on this rank (a DTensor's local shard)."""
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]
                total += local.numel() * local.element_size()
    return total
