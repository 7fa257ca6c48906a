"""The high-level worker call: train a model data-parallel under a coordinator.

:func:`train` joins the run, wraps the model in DistributedDataParallel (gloo on CPU, NCCL on
CUDA: DDP's bucketed all-reduce averages gradients, overlapped with backward), runs the epochs the
coordinator starts, keeps the weights of the best epoch and restores them at the end. It is
:meth:`Session.run_epochs` with a standard train and validation step filled in
(:mod:`epochal.worker.training.fitting`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from epochal.errors import ConfigError
from epochal.protocol.messages import MAX_METRICS, check_metric_name
from epochal.worker.checkpoints.state import (
    TrainState as TrainState,  # re-exported: importable here too
)
from epochal.worker.join import join
from epochal.worker.joinoptions import JoinOptions
from epochal.worker.session import Session
from epochal.worker.strategies import ModeOptions
from epochal.worker.training.fitting import Fitting, LoaderArg, LossFn, MetricFn
from epochal.worker.training.precision import check_clip_grad_norm, check_precision
from epochal.worker.training.results import RunResult


@dataclass(frozen=True, kw_only=True, slots=True)
class FitOptions:
    """How :func:`fit` trains; see :func:`train` for each option's meaning."""

    progress: bool | None = None
    # the in-epoch progress bar on rank 0; None: when stderr is a terminal (or EPOCHAL_PROGRESS)
    accumulate: int = 1
    # batches whose gradients are summed before one optimizer step
    mode: str = "replicated"
    # the parallel strategy (epochal.worker.strategies)
    mode_options: ModeOptions | Mapping[str, Any] | None = None
    initialize: Callable[[torch.nn.Module], None] | None = None
    # run on rank 0 before training (not on a resume), its result broadcast to every rank
    configure_ddp: Callable[[DistributedDataParallel], None] | None = None
    ddp_options: Mapping[str, Any] = field(default_factory=dict)
    # further keyword arguments of DistributedDataParallel
    clip_grad_norm: float | None = None
    # the gradients' global L2 norm is clipped to this at each optimizer step; None: no clipping
    precision: str = "32"
    # "32", "bf16" or "fp16": the dtype of autocast for the forward and the loss
    metrics: Mapping[str, MetricFn] = field(default_factory=dict)
    # named metric functions (outputs, targets) -> (sum, count), reported for both splits
    snapshot: bool = True
    # elastic runs: keep a host copy of each epoch's start, which the survivors of a lost rank
    # restore; False: they restore the last checkpoint (and redo the epochs since)
    scheduler: Any = None
    # a torch.optim.lr_scheduler on the optimizer, stepped after every optimizer step

    def __post_init__(self) -> None:
        if not isinstance(self.metrics, Mapping):
            raise ConfigError(
                "metrics must be a mapping of names to functions (outputs, targets) -> "
                f"(sum, count), got {type(self.metrics).__name__}"
            )
        if len(self.metrics) > MAX_METRICS:
            raise ConfigError(f"at most {MAX_METRICS} metrics, got {len(self.metrics)}")
        for name, metric in self.metrics.items():
            try:
                check_metric_name(name)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if not callable(metric):
                raise ConfigError(
                    f"metric {name!r} must be a function (outputs, targets) -> (sum, count), "
                    f"got {type(metric).__name__}"
                )
        if type(self.accumulate) is not int or self.accumulate < 1:
            raise ConfigError(
                f"accumulate must be a whole number of batches >= 1, got {self.accumulate!r}"
            )
        check_precision(self.precision)
        check_clip_grad_norm(self.clip_grad_norm)


FIT_OPTIONS = frozenset(f.name for f in fields(FitOptions))


def fit(
    session: Session,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: LoaderArg,
    valid_loader: LoaderArg | None,
    loss_fn: LossFn,
    options: FitOptions | None = None,
    **given: Any,
) -> RunResult:
    """Train ``model`` in an already joined ``session``; see :func:`train`.

    The keyword arguments are the fields of :class:`FitOptions` (or pass ``options``); any other
    is an option of DistributedDataParallel.
    """
    if options is None:
        ddp = {k: v for k, v in given.items() if k not in FIT_OPTIONS}
        own = {k: v for k, v in given.items() if k in FIT_OPTIONS and k != "ddp_options"}
        options = FitOptions(**own, ddp_options={**given.get("ddp_options", {}), **ddp})
    elif given:
        raise TypeError("fit() takes options or keyword arguments, not both")
    return Fitting(session, model, optimizer, train_loader, valid_loader, loss_fn, options).run()


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: LoaderArg,
    valid_loader: LoaderArg | None,
    loss_fn: LossFn,
    **options: Any,
) -> RunResult:
    """Train ``model`` data-parallel under the coordinator and return how the run went.

    ``train_loader`` / ``valid_loader`` are sized iterables of ``(inputs, targets)`` batches holding
    this rank's share of the data, or functions ``(rank, world_size) -> loader`` that build it once
    the rank is known. ``loss_fn(outputs, targets)`` returns the batch's mean loss. The coordinator
    starts each epoch, sets the learning-rate factor, and picks the best epoch by the smoothed
    validation loss (the train loss when there is no validation loader; ``--monitor`` picks a
    metric instead); the best weights are
    loaded into ``model`` before this returns. ``accumulate=N`` sums gradients over N batches
    and steps once (gradients are exchanged only on the stepping batch).

    ``mode`` is how gradients are combined and who holds the optimizer state: ``"replicated"``
    (DDP, every rank steps), ``"main"`` (rank 0 alone steps), ``"sharded"`` (ZeRO: optimizer
    state split across ranks) or ``"fully_sharded"`` (FSDP2: parameters split too); see
    :mod:`epochal.worker.strategies`. ``mode_options`` are its :class:`ModeOptions`
    (``bucket_cap_mb``, ``find_unused_parameters``, ``sync_batchnorm``, ...); ``ddp_options``
    further keyword arguments of DDP, and ``configure_ddp(ddp)`` may register a communication hook
    or the like on the DDP wrapper (replicated, sharded). ``initialize(model)`` runs on rank 0
    before training (not on a resume) and its parameters and buffers are broadcast to every rank:
    initial parameters computed from data, e.g. k-means centroids.

    ``precision`` is ``"32"`` (the default: float32 throughout), ``"bf16"`` or ``"fp16"``: the
    forward and the loss (training and validation) run under ``torch.autocast`` with that dtype,
    on CPU or CUDA, while parameters, gradients and optimizer state stay float32. ``"fp16"`` adds
    a ``torch.amp.GradScaler`` (on CPU too: float16's narrow range, not the device, is what makes
    small gradients underflow): the loss is scaled before backward, the gradients unscaled before
    the step, and a step with inf or NaN gradients is skipped on every rank while the scale
    drops; checkpoints keep the scaler's state. ``clip_grad_norm=X`` (a number > 0; default
    None, no clipping) rescales the gradients so that their global L2 norm is at most X, with
    ``torch.nn.utils.clip_grad_norm_``: once per optimizer step (after ``accumulate`` batches),
    on the gradients averaged across ranks and unscaled, over the whole model in every mode
    (fully_sharded reduces the norm of its shards).
    Other values raise :class:`~epochal.errors.ConfigError` before the run is joined.

    ``metrics`` maps names to functions ``metric(outputs, targets) -> (sum, count)``: the metric
    summed over the batch's samples and their number, e.g. ``{"accuracy": lambda out, y:
    ((out.argmax(1) == y).sum(), len(y))}``. Each is computed on every training and validation
    batch (without gradients); the coordinator sums the sums and the counts over all ranks and
    divides, so ranks with more samples weigh more, journals the values (``valid_accuracy``),
    shows the validation ones in its epoch line, and ``--monitor NAME --monitor-mode max`` picks
    the best epoch by one. The result's curve carries them (:attr:`EpochRecord.metrics`). A name
    is 1-64 letters, digits or ``_``, starting with a letter, and neither ``loss`` nor
    ``batches``.

    ``snapshot=False`` (elastic runs, ``--min-workers``): keep no host copy of each epoch's start
    (the model, optimizer and generators); the survivors of a lost rank then restore the last
    checkpoint and redo the epochs since, as the sharded modes always do. Needs a checkpoint
    directory.

    ``scheduler``: one of torch's learning-rate schedulers built on ``optimizer`` (``LambdaLR``,
    ``OneCycleLR``, ...), stepped after every optimizer step. Its place follows from the run's
    global step, so a resume or a new world goes on at the rates of an unbroken run. It sets
    every rate itself: a coordinator's ``--lr-schedule`` other than ``constant`` is refused.

    ``progress``, ``accumulate``, ``mode``, ``mode_options``, ``initialize``, ``configure_ddp``,
    ``ddp_options``, ``clip_grad_norm``, ``precision``, ``metrics``, ``snapshot`` and
    ``scheduler`` are the fields of :class:`FitOptions`;
    every other keyword argument is one of :func:`epochal.join` (``coordinator=``, ``job=``,
    ``connect_timeout=``, ..., the fields of :class:`~epochal.worker.joinoptions.JoinOptions`),
    which
    are checked before joining.
    """
    fitting = FitOptions(**{k: v for k, v in options.items() if k in FIT_OPTIONS})
    joining = JoinOptions.from_env(
        **{k: v for k, v in options.items() if k not in FIT_OPTIONS},
        metrics=tuple(fitting.metrics),  # the coordinator checks --monitor against them at once
    )
    with join(model, joining) as session:  # closed as failed if fit raises before its epochs
        return fit(session, model, optimizer, train_loader, valid_loader, loss_fn, fitting)
