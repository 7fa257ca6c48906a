"""The high-level worker call: train a model data-parallel under a coordinator.

:func:`train` joins the run, wraps the model in DistributedDataParallel (gloo on CPU, NCCL on
CUDA: DDP's bucketed all-reduce averages gradients, overlapped with backward), runs the epochs the
coordinator starts, keeps the weights of the best epoch and restores them at the end. It is
:meth:`Session.run_epochs` with a standard train and validation step filled in.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sized
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from epochal.environment import PROGRESS_ENV
from epochal.errors import ConfigError
from epochal.log import WORKER
from epochal.protocol import Restore, SnapshotScope
from epochal.protocol.messages import MAX_METRICS, check_metric_name
from epochal.text import byte_size
from epochal.worker import faults
from epochal.worker.checkpoints.state import Stateful
from epochal.worker.checkpoints.state import (
    TrainState as TrainState,  # re-exported: importable here too
)
from epochal.worker.join import join
from epochal.worker.options import JoinOptions
from epochal.worker.regroup import FullState, Snapshot, consolidate, share, share_tree
from epochal.worker.regroup import leave as leave_group
from epochal.worker.regroup import rebuild as rebuild_strategy
from epochal.worker.session import Rejoin, Session
from epochal.worker.strategies import ModeOptions, to_device, wrap
from epochal.worker.strategies.base import Strategy
from epochal.worker.strategies.layout import Layout
from epochal.worker.training.elastic import elastic_scope
from epochal.worker.training.initialization import initialize_on_rank
from epochal.worker.training.precision import check_clip_grad_norm, check_precision
from epochal.worker.training.results import EpochContext, LossSum, RunResult

Loader = Iterable[Any]
LoaderArg = Loader | Callable[[int, int], Loader]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFn = Callable[[Any, torch.Tensor], tuple[torch.Tensor | float, int]]
"""``metric(outputs, targets) -> (sum over the batch's samples, sample count)``: for accuracy
``((outputs.argmax(1) == targets).sum(), len(targets))``. The sum may be a tensor (it is added up
on the device, read once per epoch) or a number."""


class _MetricSums:
    """Running sums and counts of the named metrics over one epoch of one rank."""

    def __init__(self, metrics: Mapping[str, MetricFn], device: torch.device) -> None:
        self.metrics = metrics
        self.totals = {
            name: torch.zeros((), dtype=torch.float64, device=device) for name in metrics
        }
        self.counts = dict.fromkeys(metrics, 0)

    def add(self, outputs: Any, targets: torch.Tensor) -> None:
        if not self.metrics:
            return
        with torch.no_grad():
            for name, metric in self.metrics.items():
                total, count = metric(outputs, targets)
                if isinstance(total, torch.Tensor):
                    self.totals[name] += total.detach().double()
                else:
                    self.totals[name] += float(total)
                self.counts[name] += int(count)

    def result(self) -> dict[str, tuple[float, int]]:
        return {name: (float(t.item()), self.counts[name]) for name, t in self.totals.items()}


def _progress_enabled(rank: int, progress: bool | None) -> bool:
    if rank != 0:
        return False
    if progress is not None:
        return progress
    forced = os.environ.get(PROGRESS_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return sys.stderr.isatty()


def _resolve(loader: LoaderArg | None, session: Session, what: str) -> Loader | None:
    if loader is None:
        return None
    if callable(loader) and not isinstance(loader, Sized):
        loader = loader(session.rank, session.world_size)
    if not isinstance(loader, Sized):
        raise ConfigError(
            f"the {what} loader has no len(): epochal checks every rank's batch count before an "
            "epoch starts, so give it a sized loader (a DataLoader over a map-style dataset)"
        )
    return loader


def _set_epoch(loader: Loader, epoch: int) -> None:
    for holder in (getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        set_epoch = getattr(holder, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def _split(batch: Any, device: torch.device) -> tuple[Any, torch.Tensor, int]:
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise ConfigError(
            f"each batch must be (inputs, targets), got a {type(batch).__name__}: write a "
            "collate_fn that returns that pair, or use Session.run_epochs for a custom step"
        )
    inputs, targets = batch
    inputs = inputs.to(device, non_blocking=True) if isinstance(inputs, torch.Tensor) else inputs
    targets = targets.to(device, non_blocking=True)
    return inputs, targets, int(targets.shape[0])


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
    accumulate, mode = options.accumulate, options.mode
    user_model, user_optimizer = model, optimizer  # a new world wraps them again
    resolved = _resolve(train_loader, session, "train")
    assert resolved is not None
    train_data: Loader = resolved
    valid_data = _resolve(valid_loader, session, "validation")
    device = session.device
    initialize = options.initialize
    if initialize is not None and session.resume_epoch is None:  # a resume loads its weights
        to_device(model, device)
        initialize_on_rank(model, initialize)

    def build() -> Strategy:
        built = wrap(
            user_model,
            user_optimizer,
            device,
            mode=mode,
            options=options.mode_options,
            ddp_options=dict(options.ddp_options),
            precision=options.precision,
            clip_grad_norm=options.clip_grad_norm,
        )
        if options.configure_ddp is not None:
            if built.ddp is None:
                raise ConfigError(f"configure_ddp was given, but mode {mode!r} does not use DDP")
            built.configure = options.configure_ddp
        return built

    strategy = build()
    scope = strategy.snapshot_scope
    if session.elastic:
        scope = elastic_scope(
            mode, scope, snapshot=options.snapshot, checkpoints=session.checkpointer is not None
        )
    keeps_copy = session.elastic and scope in (SnapshotScope.WHOLE, SnapshotScope.ROOT)
    model, optimizer, policy = strategy.model, strategy.optimizer, strategy.policy
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    show_progress = _progress_enabled(session.rank, options.progress)
    best_state: dict[str, torch.Tensor] | None = None
    start: tuple[int, Snapshot] | None = None
    # elastic runs: this rank's state at the start of the epoch under way, and that epoch
    gathered: tuple[int, FullState | None] | None = None
    # elastic runs whose copies are not whole: the state an epoch starts from, gathered onto
    # rank 0 at the boundary before it for the newcomers that join then (None elsewhere, and
    # where rank 0's live state is whole already), and that epoch

    def gather(epoch: int) -> None:
        """At the boundary before ``epoch``, newcomers waiting (Decision.gather): collective in
        this world, the whole state onto rank 0 (rank 0 alone keeps it: a shard per rank
        otherwise, or nothing where its own state is whole, as with copies switched off)."""
        nonlocal gathered
        gathered = (epoch, consolidate(strategy))

    def from_peers(newcomer: bool) -> None:
        """Newcomers joined this world: every rank takes rank 0's state (model, optimizer,
        scaler) and its best epoch's weights over the data plane, a newcomer to train on, the
        others to stay equal to it. In the sharded modes rank 0 sends what it gathered at the
        boundary, and each rank keeps its part; the best epoch's weights, a shard on each rank
        of the old world, are not sent: every rank loads them from their checkpoint at the end."""
        nonlocal best_state
        full = None  # rebuild forgets what was gathered once this returns
        if gathered is not None and gathered[0] == session.start_epoch:
            full = gathered[1]
        moved = share(strategy, full=full)
        more = 0
        if strategy.snapshot_scope is SnapshotScope.SHARD:
            best_state = None
        else:
            best_state, more = share_tree(strategy, best_state)
        nbytes = moved.nbytes + more
        if newcomer:
            took = max(moved.seconds, 1e-9)
            WORKER.info(
                f"epochal: rank {session.rank}: took rank 0's state, {byte_size(nbytes)} in "
                f"{took:.2f} s ({byte_size(nbytes / took)}/s), for epoch {session.start_epoch} "
                f"in a world of {session.world_size}"
            )

    if session.restore == "peers":  # a newcomer: the run's state comes from rank 0
        from_peers(newcomer=True)

    def train_epoch(ctx: EpochContext) -> LossSum:
        nonlocal start, gathered
        gathered = None  # the world did not grow after all: the epoch is under way
        if keeps_copy and (start is None or start[0] != ctx.epoch):
            start = (ctx.epoch, Snapshot.take(strategy))
        for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * ctx.lr_factor
        _set_epoch(train_data, ctx.epoch)
        strategy.begin_epoch()
        strategy.module.train()
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        metric_sums = _MetricSums(options.metrics, device)
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=ctx.train_batches, desc=f"epoch {ctx.epoch}", leave=False, dynamic_ncols=True
            )
        for step, batch in enumerate(train_data):
            if step == ctx.train_batches:
                break
            ctx.check()
            faults.hit(
                "train-step", rank=ctx.rank, epoch=ctx.epoch, step=step, world=session.generation
            )
            inputs, targets, n = _split(batch, device)
            first = step % accumulate == 0
            group_end = min(step - step % accumulate + accumulate, ctx.train_batches)
            stepping = step + 1 == group_end
            if first:
                strategy.zero_grad()
            # gradients are exchanged only for the batch that steps; the others accumulate locally
            with nullcontext() if stepping else strategy.no_sync():
                with policy.autocast():
                    outputs = strategy.module(inputs)
                    loss = loss_fn(outputs, targets)
                    metric_sums.add(outputs, targets)
                micro = group_end - (step - step % accumulate)  # batches in this step
                policy.backward(loss / micro if micro > 1 else loss)  # fp16: scaled
            if stepping:
                strategy.step()  # unscales and clips the accumulated, averaged gradients
            total += loss.detach().double() * n
            count += n
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return LossSum(float(total.item()), count, metric_sums.result())

    def valid_epoch(ctx: EpochContext) -> LossSum:
        assert valid_data is not None
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        metric_sums = _MetricSums(options.metrics, device)
        with torch.no_grad():
            for step, batch in enumerate(valid_data):
                if step == ctx.valid_batches:
                    break
                ctx.check()
                faults.hit(
                    "valid-step",
                    rank=ctx.rank,
                    epoch=ctx.epoch,
                    step=step,
                    world=session.generation,
                )
                inputs, targets, n = _split(batch, device)
                with policy.autocast():
                    outputs = model(inputs)
                    loss = loss_fn(outputs, targets)
                    metric_sums.add(outputs, targets)
                total += loss.double() * n
                count += n
        return LossSum(float(total.item()), count, metric_sums.result())

    def keep_best(epoch: int) -> None:
        nonlocal best_state
        best_state = strategy.snapshot()

    train_state = strategy.state

    def counts(epoch: int) -> tuple[int, int | None]:
        return len(train_data), (None if valid_data is None else len(valid_data))  # type: ignore[arg-type]

    def leave(error: BaseException | None) -> None:
        leave_group(strategy, error)  # the wrappers released; the model and optimizer kept

    def rebuild(epoch: int) -> Stateful:
        """The new world's group is up: the mode again over it, the loaders for the new rank
        and world size, and the epoch's start restored."""
        nonlocal strategy, model, optimizer, policy, train_data, valid_data, best_state, gathered
        strategy = rebuild_strategy(strategy, Layout.from_group(device))
        model, optimizer, policy = strategy.model, strategy.optimizer, strategy.policy
        if session.restore == Restore.CHECKPOINT:  # the session loads it into strategy.state
            # the best epoch's weights come from its checkpoint at the end, on every rank alike:
            # a newcomer has none in memory, and a shard of the old world fits no rank of this
            best_state = None
        elif start is not None and start[0] == epoch:
            start[1].restore(strategy)
        # else the epoch had not begun here: what this rank holds is its start already
        if session.restore == "peers":
            from_peers(newcomer=False)
        gathered = None  # of the old world: sent now, or of no use (a loss came first)
        again = _resolve(train_loader, session, "train")
        assert again is not None
        train_data = again
        valid_data = _resolve(valid_loader, session, "validation")
        return strategy.state

    result = session.run_epochs(
        train_epoch,
        valid_epoch if valid_data is not None else None,
        batches=counts,
        on_best=keep_best,
        state=train_state,
        rejoin=Rejoin(leave, rebuild, scope, gather),
        learning_rate=lambda: optimizer.param_groups[0]["lr"],
    )
    if result.restore_best and result.best_epoch is not None:
        if best_state is not None:
            strategy.restore(best_state)
        else:  # the best epoch ran before a restart: its weights are in its checkpoint
            result = session.restore_best(result, strategy.model_state)
    strategy.finish()  # fully_sharded: the whole model on every rank, while the group lives
    return result


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

    ``progress``, ``accumulate``, ``mode``, ``mode_options``, ``initialize``, ``configure_ddp``,
    ``ddp_options``, ``clip_grad_norm``, ``precision``, ``metrics`` and ``snapshot`` are the
    fields of :class:`FitOptions`;
    every other keyword argument is one of :func:`epochal.join` (``coordinator=``, ``job=``,
    ``connect_timeout=``, ..., the fields of :class:`~epochal.worker.options.JoinOptions`), which
    are checked before joining.
    """
    fitting = FitOptions(**{k: v for k, v in options.items() if k in FIT_OPTIONS})
    joining = JoinOptions.from_env(
        **{k: v for k, v in options.items() if k not in FIT_OPTIONS},
        metrics=tuple(fitting.metrics),  # the coordinator checks --monitor against them at once
    )
    with join(model, joining) as session:  # closed as failed if fit raises before its epochs
        return fit(session, model, optimizer, train_loader, valid_loader, loss_fn, fitting)
