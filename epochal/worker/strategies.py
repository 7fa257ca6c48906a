"""Optimization modes: how gradients are combined and who holds the optimizer state.

:func:`wrap` turns a model and its optimizer into a :class:`Strategy` for one of four modes,
chosen per run (``fit(..., mode=...)``):

============== ============================================ ==================================
mode           gradients                                    optimizer state / parameters
============== ============================================ ==================================
replicated     DDP all-reduce (average), bucketed,          every rank holds it all and steps
               overlapped with backward                     (the default)
main           reduced (average) onto rank 0 in buckets     only rank 0 holds state and steps;
               when the step comes                          parameters broadcast back
sharded        DDP all-reduce (average)                     ZeroRedundancyOptimizer: each rank
                                                            holds and steps ~1/N of the state;
                                                            parameters stay whole
fully_sharded  FSDP2 reduce-scatter (average)               ``fully_shard``: parameters,
                                                            gradients and state all ~1/N
============== ============================================ ==================================

``main`` is burn's ``OptimMainDevice`` and lamp's root optimizer, ``sharded`` burn's
``OptimSharded``; ``fully_sharded`` is the fully sharded option of ``sharded``, for models whose
parameters do not fit one device. Every mode *averages* gradients (burn sums them, so its results
change with the device count), and every mode starts from rank 0's parameters, so after each step
all modes hold the same weights as ``replicated``, up to float rounding.

A :class:`Strategy` is what the training loop talks to: ``module`` for the training forward,
``step()``, ``zero_grad()``, ``no_sync()`` around batches that only accumulate gradients,
``optimizer`` (whose ``param_groups`` take the learning rate), and ``state``, a
``torch.distributed.checkpoint`` Stateful that saves and loads the model and the optimizer the way
the mode holds them (ZeRO's shards keyed by parameter name, FSDP2's DTensors through
``torch.distributed.checkpoint.state_dict``). The optimizer state is always keyed by parameter
name, in the format of DCP's ``get_state_dict``.

The optimizer passed in is the one that steps in ``replicated`` and ``main``. ``sharded`` and
``fully_sharded`` build their own of the same class, with the same parameter groups and
hyperparameters (ZeRO's local shard optimizer; a new one over FSDP2's sharded parameters), so the
passed optimizer is left without state: use ``Strategy.optimizer``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from epochal.errors import ConfigError, EpochalError
from epochal.worker.initialization import (
    DEFAULT_BUCKET_BYTES,
    broadcast_module,
    broadcast_tensors,
    buckets,
    is_dtensor,
    module_tensors,
)
from epochal.worker.placement import LayeredModel

MODES = ("replicated", "main", "sharded", "fully_sharded")


class Stateful(Protocol):
    """``torch.distributed.checkpoint``'s Stateful protocol: what a checkpoint holds."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeOptions:
    """Options of the optimization modes; an option a mode has no use for is refused."""

    bucket_cap_mb: float | None = None
    # gradient bucket size in MiB: DDP's (replicated, sharded) and main's reduce/broadcast buckets;
    # None: 25, DDP's default
    find_unused_parameters: bool = False
    # some parameters may get no gradient in a step (a branch not taken): DDP's option of that
    # name (replicated, sharded); in main, a parameter no rank has a gradient for is left
    # without one, so the optimizer skips it
    sync_batchnorm: bool = False
    # turn every BatchNorm into SyncBatchNorm, batch statistics over all ranks (replicated, main,
    # sharded); torch's SyncBatchNorm trains on CUDA devices only
    reshard_after_forward: bool = True
    # fully_sharded: free the gathered parameters after forward and gather them again in backward
    shard_units: Callable[[nn.Module], Iterable[nn.Module]] | None = None
    # fully_sharded: the submodules fully_shard wraps one by one (each its own all-gather), before
    # the root; None: every child with parameters, looking inside ModuleList and ModuleDict

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be > 0 MiB, got {self.bucket_cap_mb}")


# which mode has a use for which option (and for DDP's own keyword arguments)
_APPLIES = {
    "bucket_cap_mb": ("replicated", "main", "sharded"),
    "find_unused_parameters": ("replicated", "main", "sharded"),
    "sync_batchnorm": ("replicated", "main", "sharded"),
    "reshard_after_forward": ("fully_sharded",),
    "shard_units": ("fully_sharded",),
}
_DDP_MODES = ("replicated", "sharded")


def mode_options(options: ModeOptions | Mapping[str, Any] | None) -> ModeOptions:
    """``options`` as a :class:`ModeOptions`; a mapping's unknown keys are refused by name."""
    if options is None:
        return ModeOptions()
    if isinstance(options, ModeOptions):
        return options
    known = [f.name for f in fields(ModeOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown mode option(s) {', '.join(unknown)}: the options are {', '.join(known)} "
            "(DDP's other keyword arguments go in ddp_options)"
        )
    return ModeOptions(**options)


def _check_applies(mode: str, opts: ModeOptions, ddp_options: Mapping[str, Any]) -> None:
    defaults = ModeOptions()
    for name, modes in _APPLIES.items():
        if getattr(opts, name) != getattr(defaults, name) and mode not in modes:
            raise ConfigError(
                f"{name} has no meaning in mode {mode!r} (it applies to {', '.join(modes)}): "
                "drop it or pick one of those modes"
            )
    if ddp_options and mode not in _DDP_MODES:
        raise ConfigError(
            f"mode {mode!r} does not use DistributedDataParallel, so it takes no DDP options "
            f"({', '.join(sorted(ddp_options))}); they apply to {', '.join(_DDP_MODES)}"
        )
    clash = [n for n in ("bucket_cap_mb", "find_unused_parameters") if n in ddp_options]
    clash = [n for n in clash if getattr(opts, n) != getattr(defaults, n)]
    if clash:
        raise ConfigError(
            f"give {', '.join(sorted(clash))} as a mode option, not in ddp_options as well"
        )


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its class's constructor accepts (AdamW implies some itself)."""
    signature = inspect.signature(type(optimizer).__init__)
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in signature.parameters}


def _groups_by_name(
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


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if is_dtensor(value) else value  # type: ignore[attr-defined]
                total += local.numel() * local.element_size()
    return total


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer without state its state tensors: a step with zero gradients at lr 0.

    DCP's ``get_state_dict`` does the same, so that a fresh optimizer has tensors to load into.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    for p, g in zip(params, grads, strict=True):
        p.grad = g


class ModelState:
    """The model alone as a DCP Stateful (restoring the best epoch's weights)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])


class Strategy:
    """One mode's way of training ``model`` with ``optimizer``; built by :func:`wrap`."""

    mode: ClassVar[str]

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        module: nn.Module,
        ddp: DistributedDataParallel | None = None,
    ) -> None:
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

    def begin_epoch(self) -> None:
        """Before each training epoch: DDP modes start the epoch with a fresh reducer.

        DDP lays its gradient buckets out anew after the first backward it sees, and the layout
        decides the order in which a bucket's elements are summed across ranks. A run resumed
        after epoch k would run epoch k+1's first step with the initial layout where the
        uninterrupted run used the rebuilt one: with three ranks or more (where float addition
        order matters) the weights then differ in the last bits. A fresh reducer every epoch
        (no parameter broadcast: ``init_sync=False``) makes every epoch start alike, so resume is
        bit-identical at any world size, for the cost of building the reducer once an epoch.
        """
        if self._fresh_ddp is None:
            return
        self.ddp = self._fresh_ddp()
        self.module = self.ddp
        if self.configure is not None:
            self.configure(self.ddp)

    @property
    def state(self) -> Stateful:
        """Model and optimizer, as this mode holds them, for a checkpoint."""
        from epochal.worker.train import TrainState  # train imports this module

        return TrainState(self.model, self.optimizer)

    @property
    def model_state(self) -> Stateful:
        """The model alone, for a checkpoint's weights."""
        return ModelState(self.model)

    def step(self) -> None:
        """Apply the averaged gradients: every rank ends with the same parameters."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> AbstractContextManager[Any]:
        """Around the forward and backward of a batch that only accumulates gradients."""
        return self.ddp.no_sync() if self.ddp is not None else nullcontext()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds."""
        return _state_bytes(self.optimizer)

    def finish(self) -> None:
        """When training ends, while the process group lives: leave ``model`` whole on every rank,
        a plain module usable without the group. Collective in modes that shard the model."""

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this rank's model state, for :meth:`restore` (the best epoch's)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(snapshot)


class _BuffersFromRoot:
    """A DDP mode's checkpoint: ``inner``, with rank 0's buffers on every rank before it is read.

    DDP broadcasts rank 0's buffers (BatchNorm statistics) before each forward, so between
    forwards the other ranks hold rank 0's plus one batch of their own; a checkpoint keeps one
    copy of each replicated tensor, written by whichever rank DCP picks. Giving every rank rank
    0's first makes that copy rank 0's, and a resumed run equal to an uninterrupted one.
    """

    def __init__(self, inner: Stateful, ddp: DistributedDataParallel) -> None:
        self.inner = inner
        self.ddp = ddp

    def state_dict(self) -> dict[str, Any]:
        buffers = list(self.ddp.module.buffers())
        if self.ddp.broadcast_buffers and buffers:  # collective: DCP asks every rank
            root = dist.get_global_rank(self.ddp.process_group, 0)
            broadcast_tensors(buffers, src=root, group=self.ddp.process_group)
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class Replicated(Strategy):
    """DDP: gradients all-reduced in buckets during backward; every rank steps the optimizer."""

    mode = "replicated"

    @property
    def state(self) -> Stateful:
        assert self.ddp is not None
        return _BuffersFromRoot(super().state, self.ddp)


class Main(Strategy):
    """Gradients averaged onto rank 0, which alone holds optimizer state and steps; parameters
    are broadcast back. Communication happens in :meth:`step`, so accumulation needs no
    ``no_sync`` and the batches before a step exchange nothing."""

    mode = "main"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        bucket_bytes: int,
        find_unused_parameters: bool,
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(model, optimizer, model)
        self._group = group
        self._root = 0 if group is None else dist.get_global_rank(group, 0)
        self.is_root = dist.get_rank() == self._root
        self._world = dist.get_world_size(group)
        self._find_unused = find_unused_parameters
        self._bucket_bytes = bucket_bytes
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buckets = buckets(self._params, bucket_bytes)
        self._tensors = module_tensors(model)
        broadcast_tensors(self._tensors, src=self._root, group=group, cap_bytes=bucket_bytes)

    @property
    def state(self) -> Stateful:
        return _MainState(self.model, self.optimizer, self.is_root)

    def step(self) -> None:
        used: dict[int, bool] | None = None
        if self._find_unused:
            mask = torch.tensor(
                [p.grad is not None for p in self._params],
                dtype=torch.int32,
                device=self._params[0].device if self._params else None,
            )
            dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self._group)
            used = {id(p): bool(m) for p, m in zip(self._params, mask.tolist(), strict=True)}
        with torch.no_grad():
            for bucket in self._buckets:
                flat = torch.cat(
                    [
                        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                        for p in bucket
                    ]
                )
                flat.div_(self._world)  # DDP's order: divide, then sum
                dist.reduce(flat, dst=self._root, op=dist.ReduceOp.SUM, group=self._group)
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
        if self.is_root:
            self.optimizer.step()
        broadcast_tensors(
            self._tensors, src=self._root, group=self._group, cap_bytes=self._bucket_bytes
        )

    def optimizer_state_bytes(self) -> int:
        return _state_bytes(self.optimizer) if self.is_root else 0


class _MainState:
    """Main mode's checkpoint: every rank's model, rank 0's optimizer (the only one with state).

    Rank 0's part has the format of :class:`~epochal.worker.train.TrainState`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, is_root: bool) -> None:
        self.model = model
        self.optimizer = optimizer
        self.is_root = is_root

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not self.is_root:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if not self.is_root:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


class Sharded(Strategy):
    """DDP for gradients, ``ZeroRedundancyOptimizer`` for the step: each rank keeps and steps the
    optimizer state of its share of the parameters, then broadcasts their new values."""

    mode = "sharded"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ddp: DistributedDataParallel,
        group: dist.ProcessGroup | None,
    ) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
        try:
            zero = ZeroRedundancyOptimizer(
                groups,
                optimizer_class=type(optimizer),
                process_group=group,
                **_constructor_kwargs(optimizer),
            )
        except TypeError as exc:
            raise ConfigError(
                f"cannot build a sharded {type(optimizer).__name__}: {exc}; mode 'sharded' builds "
                "the optimizer again from its class and defaults"
            ) from None
        super().__init__(model, zero, ddp, ddp)
        self.zero = zero

    @property
    def state(self) -> Stateful:
        assert self.ddp is not None
        return _BuffersFromRoot(_ShardedState(self.model, self.zero), self.ddp)

    def optimizer_state_bytes(self) -> int:
        return _state_bytes(self.zero.optim)


class _ShardedState:
    """ZeRO's checkpoint: the model, and each rank's own shard of the optimizer state.

    Keyed by parameter name in DCP's ``get_state_dict`` format (``optim.state.<name>.<key>``,
    ``optim.param_groups`` with parameter names): each rank writes the state of the parameters it
    owns, so the shards are disjoint, and loads those it owns now, whatever rank wrote them.
    """

    def __init__(self, model: nn.Module, zero: Any) -> None:
        self.model = model
        self.zero = zero
        self.names = {id(p): name for name, p in model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        local: torch.optim.Optimizer = self.zero.optim
        _init_state(local)
        state = {
            self.names[id(p)]: dict(local.state[p])
            for group in local.param_groups
            for p in group["params"]
            if p in local.state
        }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": self._names(g)}
            for g in self.zero.param_groups
        ]
        return {
            "model": get_model_state_dict(self.model),
            "optim": {"state": state, "param_groups": groups},
        }

    def _names(self, group: dict[str, Any]) -> list[str]:
        return [self.names[id(p)] for p in group["params"]]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])
        saved = state["optim"]
        if [g["params"] for g in saved["param_groups"]] != [
            self._names(g) for g in self.zero.param_groups
        ]:
            raise EpochalError(
                "the checkpoint's optimizer has other parameter groups than this one: build the "
                "optimizer with the same groups the run was started with"
            )
        local: torch.optim.Optimizer = self.zero.optim
        own_state: dict[int, Any] = {}
        own_groups = []
        index = 0
        for g_local, g_saved, g_zero in zip(
            local.param_groups, saved["param_groups"], self.zero.param_groups, strict=True
        ):
            hyper = {k: v for k, v in g_saved.items() if k != "params"}
            g_zero.update(hyper)
            ids = []
            for p in g_local["params"]:
                if self.names[id(p)] in saved["state"]:
                    own_state[index] = saved["state"][self.names[id(p)]]
                ids.append(index)
                index += 1
            own_groups.append({**hyper, "params": ids})
        local.load_state_dict({"state": own_state, "param_groups": own_groups})


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
    was (:func:`epochal.worker.unshard.unshard`), so ``model`` holds full weights after
    ``train()`` returns, as in the other modes. The checkpoints hold it sharded (DCP reshards on
    load).
    """

    mode = "fully_sharded"

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        opts: ModeOptions,
        group: dist.ProcessGroup | None,
    ) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard

        groups = _groups_by_name(model, optimizer)
        root = 0 if group is None else dist.get_global_rank(group, 0)
        broadcast_module(model, src=root, group=group)  # start where DDP starts: rank 0's weights
        world = dist.get_world_size(group)
        mesh = (
            init_device_mesh(device.type, (world,))
            if group is None
            else DeviceMesh.from_group(group, device.type)
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
                **_constructor_kwargs(optimizer),
            )
        except TypeError as exc:
            raise ConfigError(
                f"cannot rebuild {type(optimizer).__name__} over the sharded parameters: {exc}"
            ) from None
        super().__init__(model, rebuilt, model)
        self._root, self._group = root, group
        self._buffers = list(model.buffers())  # FSDP2 leaves buffers whole and unsynchronised

    def step(self) -> None:
        self.optimizer.step()
        # DDP broadcasts rank 0's buffers (BatchNorm statistics); so does every mode here
        broadcast_tensors(self._buffers, src=self._root, group=self._group)

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
        from epochal.worker.unshard import unshard

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


def _sync_batchnorm(
    model: nn.Module, device: torch.device, group: dist.ProcessGroup | None
) -> nn.Module:
    if device.type == "cpu" or any(p.device.type == "cpu" for p in model.parameters()):
        raise ConfigError(
            "sync_batchnorm needs CUDA devices: torch's SyncBatchNorm raises 'SyncBatchNorm "
            "expected input tensor to be on GPU' when it trains on CPU; drop the option (each "
            "rank then normalises with its own batch statistics) or train on GPUs"
        )
    converted: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(  # type: ignore[no-untyped-call]
        model, process_group=group
    )
    return converted


def to_device(model: nn.Module, device: torch.device) -> None:
    """Move ``model`` to ``device``, unless it is a LayeredModel: that stays where it is placed."""
    if not isinstance(model, LayeredModel):
        model.to(device)


def wrap(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    mode: str = "replicated",
    options: ModeOptions | Mapping[str, Any] | None = None,
    ddp_options: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> Strategy:
    """Prepare ``model`` and ``optimizer`` for data-parallel training in ``mode``. Collective.

    Moves the model to ``device`` (a :class:`~epochal.worker.placement.LayeredModel` stays where
    it was placed) and gives every rank rank 0's parameters and buffers. ``options`` are
    :class:`ModeOptions` (or a mapping of them); ``ddp_options`` are further keyword arguments of
    ``DistributedDataParallel`` (replicated, sharded). ``group`` is the process group of the data
    parallelism (default: every rank).
    """
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}: pick one of {', '.join(MODES)}")
    opts = mode_options(options)
    extra = dict(ddp_options or {})
    _check_applies(mode, opts, extra)
    placed = isinstance(model, LayeredModel)
    if isinstance(model, LayeredModel) and mode == "fully_sharded" and len(model.devices) > 1:
        raise ConfigError(
            "a model placed over several devices cannot be fully sharded (one FSDP2 mesh has one "
            "device type and index per rank): use mode replicated, main or sharded with it"
        )
    if not dist.is_initialized():
        raise ConfigError("wrap needs a process group: join the run first (epochal.join)")
    to_device(model, device)
    if mode != "replicated":  # the others rebuild the optimizer or broadcast the model's tensors
        _groups_by_name(model, optimizer)  # so it must hold this model's parameters only
    if opts.sync_batchnorm:
        model = _sync_batchnorm(model, device, group)
    if mode == "main":
        cap = opts.bucket_cap_mb
        return Main(
            model,
            optimizer,
            bucket_bytes=DEFAULT_BUCKET_BYTES if cap is None else int(cap * 1024 * 1024),
            find_unused_parameters=opts.find_unused_parameters,
            group=group,
        )
    if mode == "fully_sharded":
        return FullySharded(model, optimizer, device, opts, group)
    if opts.bucket_cap_mb is not None:
        extra["bucket_cap_mb"] = opts.bucket_cap_mb
    if opts.find_unused_parameters:
        extra["find_unused_parameters"] = True
    one_cuda = device.type == "cuda" and not placed  # DDP takes no device_ids for several
    device_ids = [device] if one_cuda else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=group, **extra)
    strategy = (
        Sharded(model, optimizer, ddp, group)
        if mode == "sharded"
        else Replicated(model, optimizer, ddp, ddp)
    )
    strategy._fresh_ddp = lambda: DistributedDataParallel(
        model, device_ids=device_ids, process_group=group, init_sync=False, **extra
    )
    return strategy
