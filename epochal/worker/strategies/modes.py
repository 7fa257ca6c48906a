"""The list of modes, and :func:`wrap`, which checks a call against a mode's declarations and
builds it.

:data:`STRATEGIES` maps each :class:`~epochal.worker.strategies.strategy.Mode` to its class; the
options a mode takes, whether it takes DDP options and which models it refuses are read from the
class, so adding a mode is a new module and one entry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epochal.errors import ConfigError
from epochal.worker.strategies.fully_sharded import FullySharded
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.main import Main
from epochal.worker.strategies.modeoptions import ModeOptions, mode_options, option_names
from epochal.worker.strategies.replicated import Replicated
from epochal.worker.strategies.sharded import Sharded
from epochal.worker.strategies.strategy import Mode, Strategy, groups_by_name
from epochal.worker.training.placement import LayeredModel
from epochal.worker.training.precision import Precision, StepPolicy

STRATEGIES: dict[Mode, type[Strategy]] = {
    cls.mode: cls for cls in (Replicated, Main, Sharded, FullySharded)
}
MODES: tuple[Mode, ...] = tuple(STRATEGIES)


def strategy_class(mode: str) -> type[Strategy]:
    """The class of ``mode``; an unknown name is refused with the known ones."""
    try:
        return STRATEGIES[Mode(mode)]
    except ValueError:
        raise ConfigError(f"unknown mode {mode!r}: pick one of {', '.join(MODES)}") from None


def _check_applies(cls: type[Strategy], opts: ModeOptions, ddp_options: Mapping[str, Any]) -> None:
    defaults = ModeOptions()
    for name in option_names():
        if getattr(opts, name) != getattr(defaults, name) and name not in cls.options:
            modes = [m for m, other in STRATEGIES.items() if name in other.options]
            raise ConfigError(
                f"{name} has no meaning in mode {cls.mode.value!r} (it applies to "
                f"{', '.join(modes)}): drop it or pick one of those modes"
            )
    ddp_modes = [m for m, other in STRATEGIES.items() if other.uses_ddp]
    if ddp_options and not cls.uses_ddp:
        raise ConfigError(
            f"mode {cls.mode.value!r} does not use DistributedDataParallel, so it takes no DDP "
            f"options ({', '.join(sorted(ddp_options))}); they apply to {', '.join(ddp_modes)}"
        )
    clash = [n for n in ("bucket_cap_mb", "find_unused_parameters") if n in ddp_options]
    clash = [n for n in clash if getattr(opts, n) != getattr(defaults, n)]
    if clash:
        raise ConfigError(
            f"give {', '.join(sorted(clash))} as a mode option, not in ddp_options as well"
        )


def _sync_batchnorm(model: nn.Module, layout: Layout) -> nn.Module:
    if layout.device.type == "cpu" or any(p.device.type == "cpu" for p in model.parameters()):
        raise ConfigError(
            "sync_batchnorm needs CUDA devices: torch's SyncBatchNorm raises 'SyncBatchNorm "
            "expected input tensor to be on GPU' when it trains on CPU; drop the option (each "
            "rank then normalises with its own batch statistics) or train on GPUs"
        )
    converted: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(  # type: ignore[no-untyped-call]
        model, process_group=layout.group
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
    mode: str = Mode.REPLICATED,
    options: ModeOptions | Mapping[str, Any] | None = None,
    ddp_options: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    precision: str = Precision.FP32,
    clip_grad_norm: float | None = None,
) -> Strategy:
    """Prepare ``model`` and ``optimizer`` for data-parallel training in ``mode``. Collective.

    Moves the model to ``device`` (a :class:`~epochal.worker.training.placement.LayeredModel` stays
    where it was placed) and gives every rank rank 0's parameters and buffers. ``options`` are
    :class:`ModeOptions` (or a mapping of them); ``ddp_options`` are further keyword arguments of
    ``DistributedDataParallel`` (replicated, sharded). ``group`` is the process group of the data
    parallelism (default: every rank); with ``device`` it makes the strategy's
    :class:`~epochal.worker.strategies.layout.Layout` (``Strategy.layout``), read once from
    ``torch.distributed``. ``precision`` (``"32"``, ``"bf16"``, ``"fp16"``) and ``clip_grad_norm``
    (a float > 0 or None) make the strategy's :class:`~epochal.worker.training.precision.StepPolicy`
    (``Strategy.policy``): the loop's forward runs under ``policy.autocast()``, its backward through
    ``policy.backward(loss)``, and :meth:`Strategy.step` unscales and clips.
    """
    policy = StepPolicy(precision, clip_grad_norm, device.type)  # refuses bad values first
    cls = strategy_class(mode)
    opts = mode_options(options)
    extra = dict(ddp_options or {})
    _check_applies(cls, opts, extra)
    cls.check_model(model)
    layout = Layout.from_group(device, group, placed=isinstance(model, LayeredModel))
    to_device(model, device)
    if cls.optimizer_of_model_only:
        groups_by_name(model, optimizer)  # refuses an optimizer over other parameters
    if opts.sync_batchnorm:
        model = _sync_batchnorm(model, layout)
    strategy = cls.build(model, optimizer, layout, opts, extra)
    strategy.policy = policy
    strategy.opts, strategy.ddp_options = opts, extra  # for a rebuild over another group
    return strategy
