"""One training run of :func:`~epochal.worker.training.train.fit`, across the worlds it trains in.

:class:`Fitting` holds what the standard train and validation steps share: the mode wrapped
around the user's model and optimizer (:mod:`epochal.worker.strategies`), the loaders, the best
epoch's weights, and, in elastic runs, the state an epoch starts from. It hands
:meth:`Session.run_epochs` its steps, and rebuilds them when the world changes: the group left,
the mode again over the new group, the epoch's start restored or taken from rank 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from epochal.environment import PROGRESS_ENV
from epochal.errors import ConfigError
from epochal.log import WORKER
from epochal.protocol import Restore, SnapshotScope
from epochal.steprates import warmup_cosine
from epochal.text import byte_size
from epochal.worker import faults
from epochal.worker.checkpoints.state import Stateful, whole_on_root
from epochal.worker.regroup import FullState, Snapshot, consolidate, share, share_tree
from epochal.worker.regroup import leave as leave_group
from epochal.worker.regroup import rebuild as rebuild_strategy
from epochal.worker.session import Rejoin, Session
from epochal.worker.strategies import to_device, wrap
from epochal.worker.strategies.layout import Layout
from epochal.worker.strategies.strategy import Strategy
from epochal.worker.training.elastic import elastic_scope
from epochal.worker.training.feeding import Feed
from epochal.worker.training.initialization import initialize_on_rank
from epochal.worker.training.passes import PassBatches
from epochal.worker.training.positioning import has_len, set_epochs
from epochal.worker.training.results import EpochContext, LossSum, RunResult
from epochal.worker.training.scheduling import StepScheduler

if TYPE_CHECKING:
    from epochal.worker.training.train import FitOptions

Loader = Iterable[Any]
LoaderArg = Loader | PassBatches | Callable[[int, int], Loader]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFn = Callable[[Any, torch.Tensor], tuple[torch.Tensor | float, int]]
"""``metric(outputs, targets) -> (sum over the batch's samples, sample count)``: for accuracy
``((outputs.argmax(1) == targets).sum(), len(targets))``. The sum may be a tensor (it is added up
on the device, read once per epoch) or a number."""


class _EpochSums:
    """Running sums over one epoch of one rank: the loss over its samples, and the named metrics'
    sums and counts."""

    def __init__(self, metrics: Mapping[str, MetricFn], device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)
        self.samples = 0
        self.metrics = metrics
        self.totals = {
            name: torch.zeros((), dtype=torch.float64, device=device) for name in metrics
        }
        self.counts = dict.fromkeys(metrics, 0)

    def add_loss(self, loss: torch.Tensor, samples: int) -> None:
        """A batch's mean ``loss`` over its ``samples``."""
        self.total += loss.detach().double() * samples
        self.samples += samples

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

    def result(self) -> LossSum:
        """The epoch's sums, read off the device once."""
        metrics = {name: (float(t.item()), self.counts[name]) for name, t in self.totals.items()}
        return LossSum(float(self.total.item()), self.samples, metrics)


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
    """``loader`` for this rank and world size. A train loader without len() (a stream) needs
    steps per epoch, which say where its epochs end."""
    if loader is None:
        return None
    steps = session.steps_per_epoch if what == "train" else None
    if isinstance(loader, PassBatches):
        return loader.loader(session.rank, session.world_size, endless=steps is not None)
    if callable(loader) and not isinstance(loader, Sized):
        loader = loader(session.rank, session.world_size)
    if not has_len(loader) and steps is None:
        more = " or run with --steps-per-epoch N" if what == "train" else ""
        raise ConfigError(
            f"the {what} loader has no len() (a stream?): an epoch of one pass cannot end where "
            "every rank's does, so give it a sized loader (a DataLoader over a map-style "
            f"dataset){more}"
        )
    return loader


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


class Fitting:
    """The standard steps of :func:`~epochal.worker.training.train.fit` in ``session``, over
    ``model`` and ``optimizer`` as ``options`` wrap them; :meth:`run` trains."""

    def __init__(
        self,
        session: Session,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: LoaderArg,
        valid_loader: LoaderArg | None,
        loss_fn: LossFn,
        options: FitOptions,
    ) -> None:
        self.session = session
        self.user_model, self.user_optimizer = model, optimizer  # a new world wraps them again
        self.train_loader, self.valid_loader = train_loader, valid_loader
        self.loss_fn = loss_fn
        self.options = options
        self.train_data, self.valid_data = self._loaders()
        self.feed = self._feed()
        self.device = session.device
        if options.initialize is not None and session.resume_epoch is None:
            # a resume loads its weights
            to_device(model, self.device)
            initialize_on_rank(model, options.initialize)
        self.strategy = self._build()
        self.scope = self.strategy.snapshot_scope
        if session.elastic:
            self.scope = elastic_scope(
                options.mode,
                self.scope,
                snapshot=options.snapshot,
                checkpoints=session.checkpointer is not None,
            )
        self.keeps_copy = session.elastic and self.scope in (
            SnapshotScope.WHOLE,
            SnapshotScope.ROOT,
        )
        self.model, self.optimizer = self.strategy.model, self.strategy.optimizer
        self.policy = self.strategy.policy
        self.scheduler = self._scheduler()
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.show_progress = _progress_enabled(session.rank, options.progress)
        self.best_state: dict[str, torch.Tensor] | None = None
        self.start: tuple[int, Snapshot] | None = None
        """Elastic runs: this rank's state at the start of the epoch under way, and that epoch."""
        self.gathered: tuple[int, FullState | None] | None = None
        """Elastic runs whose copies are not whole: the state an epoch starts from, gathered onto
        rank 0 at the boundary before it for the newcomers that join then (None elsewhere, and
        where rank 0's live state is whole already), and that epoch."""

    def run(self) -> RunResult:
        """Train to the run's end; the best epoch's weights are in the model after."""
        session = self.session
        if session.restore == "peers":  # a newcomer: the run's state comes from rank 0
            self._from_peers(newcomer=True)
        result = session.run_epochs(
            self._train_epoch,
            self._valid_epoch if self.valid_data is not None else None,
            batches=self._counts,
            on_best=self._keep_best,
            state=_WithRankState(self),
            rejoin=Rejoin(self._leave, self._rebuild, self.scope, self._gather),
            learning_rate=lambda: self.optimizer.param_groups[0]["lr"],
            passes=None if self.feed is None else lambda: self.feed.shape(),  # type: ignore[union-attr]
        )
        if result.restore_best and result.best_epoch is not None:
            if self.best_state is not None:
                self.strategy.restore(self.best_state)
            else:  # the best epoch ran before a restart: its weights are in its checkpoint
                result = session.restore_best(result, self.strategy.model_state)
        self.strategy.finish()  # fully_sharded: the whole model on every rank, while it has a group
        return result

    def _loaders(self) -> tuple[Loader, Loader | None]:
        """The loaders for this rank and world size."""
        train_data = _resolve(self.train_loader, self.session, "train")
        assert train_data is not None
        return train_data, _resolve(self.valid_loader, self.session, "validation")

    def _feed(self) -> Feed | None:
        """With steps per epoch, the training batches across epochs; None: an epoch is a pass."""
        steps = self.session.steps_per_epoch
        if steps is None:
            return None
        session = self.session
        return Feed(
            self.train_data, steps * self.options.accumulate, session.world_size, session.rank
        )

    def _scheduler(self) -> StepScheduler | None:
        """The user's per-step scheduler, checked against this run; None: none given."""
        if self.options.scheduler is None:
            return None
        if self.session.lr_steps is not None:
            raise ConfigError(
                "train(scheduler=) and the coordinator's --lr-schedule warmup-cosine both set "
                "the rate of every step: keep one of the two"
            )
        if self.strategy.optimizer is not self.user_optimizer:
            raise ConfigError(
                f"train(scheduler=) needs a mode that steps the optimizer it was built on, and "
                f"mode {self.options.mode!r} steps another: use mode='replicated' or "
                "'fully_sharded'"
            )
        return StepScheduler(self.options.scheduler, self.user_optimizer)

    def _build(self) -> Strategy:
        options, mode = self.options, self.options.mode
        built = wrap(
            self.user_model,
            self.user_optimizer,
            self.device,
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

    def _gather(self, epoch: int) -> None:
        """At the boundary before ``epoch``, newcomers waiting (Decision.gather): collective in
        this world, the whole state onto rank 0 (rank 0 alone keeps it: a shard per rank
        otherwise, or nothing where its own state is whole, as with copies switched off)."""
        self.gathered = (epoch, consolidate(self.strategy))

    def _from_peers(self, newcomer: bool) -> None:
        """Newcomers joined this world: every rank takes rank 0's state (model, optimizer,
        scaler) and its best epoch's weights over the data plane, a newcomer to train on, the
        others to stay equal to it. In the sharded modes rank 0 sends what it gathered at the
        boundary, and each rank keeps its part; the best epoch's weights, a shard on each rank
        of the old world, are not sent: every rank loads them from their checkpoint at the end."""
        session, strategy = self.session, self.strategy
        full = None  # rebuild forgets what was gathered once this returns
        if self.gathered is not None and self.gathered[0] == session.start_epoch:
            full = self.gathered[1]
        moved = share(strategy, full=full)
        more = 0
        if strategy.snapshot_scope is SnapshotScope.SHARD:
            self.best_state = None
        else:
            self.best_state, more = share_tree(strategy, self.best_state)
        nbytes = moved.nbytes + more
        if newcomer:
            took = max(moved.seconds, 1e-9)
            WORKER.info(
                f"epochal: rank {session.rank}: took rank 0's state, {byte_size(nbytes)} in "
                f"{took:.2f} s ({byte_size(nbytes / took)}/s), for epoch {session.start_epoch} "
                f"in a world of {session.world_size}"
            )

    def _train_epoch(self, ctx: EpochContext) -> LossSum:
        strategy = self.strategy
        self.gathered = None  # the world did not grow after all: the epoch is under way
        if self.keeps_copy and (self.start is None or self.start[0] != ctx.epoch):
            self.start = (ctx.epoch, Snapshot.take(strategy))
        self._epoch_rate(ctx)
        if self.feed is None:
            set_epochs(self.train_data, ctx.epoch)
        strategy.begin_epoch()
        strategy.module.train()
        sums = _EpochSums(self.options.metrics, self.device)
        bar = None
        if self.show_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=ctx.train_batches, desc=f"epoch {ctx.epoch}", leave=False, dynamic_ncols=True
            )
        data = self.train_data if self.feed is None else self.feed.epoch(ctx.epoch)
        steps = self._steps(ctx, data, ctx.train_batches, "train-step", bar)
        for step, inputs, targets, n in steps:
            loss = self._train_step(ctx, step, inputs, targets, sums)
            sums.add_loss(loss, n)
        return sums.result()

    def _steps(
        self, ctx: EpochContext, data: Loader, batches: int, point: str, bar: Any = None
    ) -> Iterator[tuple[int, Any, torch.Tensor, int]]:
        """The first ``batches`` batches of ``data``, as ``(step, inputs, targets, samples)`` on
        the device: before each an abort check (a stop or a lost world raises) and the fault
        point ``point``, after each a tick of the progress ``bar``, closed at the end. Like a loop
        over ``data``, it asks ``data`` for the batch after the last one it hands out (a feed
        ends its epoch there)."""
        for step, batch in enumerate(data):
            if step == batches:
                break
            ctx.check()
            faults.hit(
                point,
                rank=ctx.rank,
                epoch=ctx.epoch,
                step=step,
                world=self.session.generation,
            )
            yield (step, *_split(batch, self.device))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()

    def _train_step(
        self,
        ctx: EpochContext,
        step: int,
        inputs: Any,
        targets: torch.Tensor,
        sums: _EpochSums,
    ) -> torch.Tensor:
        """Forward and backward of batch ``step``, and the optimizer's step where it ends a group
        of ``accumulate`` batches; the batch's loss."""
        strategy, policy, accumulate = self.strategy, self.policy, self.options.accumulate
        first = step % accumulate == 0
        group_end = min(step - step % accumulate + accumulate, ctx.train_batches)
        stepping = step + 1 == group_end
        if first:
            strategy.zero_grad()
        # gradients are exchanged only for the batch that steps; the others accumulate locally
        with nullcontext() if stepping else strategy.no_sync():
            with policy.autocast():
                outputs = strategy.module(inputs)
                loss = self.loss_fn(outputs, targets)
                sums.add(outputs, targets)
            micro = group_end - (step - step % accumulate)  # batches in this step
            policy.backward(loss / micro if micro > 1 else loss)  # fp16: scaled
        if stepping:
            self._step_rate(ctx.epoch, step // accumulate)
            strategy.step()  # unscales and clips the accumulated, averaged gradients
            if self.scheduler is not None:
                self.scheduler.step()
        return loss

    def _epoch_rate(self, ctx: EpochContext) -> None:
        """The rate an epoch starts at: the coordinator's factor times the initial rates, or the
        user's scheduler placed at the epoch's first global step."""
        if self.scheduler is None:
            for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = base * ctx.lr_factor
            return
        if ctx.lr_factor != 1.0:
            raise ConfigError(
                f"the coordinator's --lr-schedule sets a factor of {ctx.lr_factor:g} for epoch "
                f"{ctx.epoch}, and train(scheduler=) sets every step's rate: keep one of the two"
            )
        steps = self.session.steps_per_epoch
        if steps is None:  # an epoch is a pass: its optimizer steps, every epoch alike
            steps = -(-ctx.train_batches // self.options.accumulate)
        self.scheduler.place(ctx.epoch * steps)

    def _step_rate(self, epoch: int, step: int) -> None:
        """A per-step schedule: set the rate of optimizer step ``step`` of ``epoch`` from the
        run's global step, so a resume or a new world finds the same rate at the same step."""
        rates, steps = self.session.lr_steps, self.session.steps_per_epoch
        if rates is None or steps is None:
            return
        factor = warmup_cosine(
            epoch * steps + step, warmup=rates.warmup, steps=rates.steps, floor=rates.floor
        )
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def _valid_epoch(self, ctx: EpochContext) -> LossSum:
        valid_data = self.valid_data
        assert valid_data is not None
        model = self.model
        model.eval()
        sums = _EpochSums(self.options.metrics, self.device)
        steps = self._steps(ctx, valid_data, ctx.valid_batches, "valid-step")
        with torch.no_grad():
            for _, inputs, targets, n in steps:
                with self.policy.autocast():
                    outputs = model(inputs)
                    loss = self.loss_fn(outputs, targets)
                    sums.add(outputs, targets)
                sums.add_loss(loss, n)
        return sums.result()

    def _keep_best(self, epoch: int) -> None:
        self.best_state = self.strategy.snapshot(into=self.best_state)

    def _counts(self, epoch: int) -> tuple[int, int | None]:
        valid = None if self.valid_data is None else len(self.valid_data)  # type: ignore[arg-type]
        if self.feed is not None:
            return self.feed.batches_per_epoch, valid
        return len(self.train_data), valid  # type: ignore[arg-type]

    def _leave(self, error: BaseException | None) -> None:
        leave_group(self.strategy, error)  # the wrappers released; the model and optimizer kept

    def _rebuild(self, epoch: int) -> Stateful:
        """The new world's group is up: the mode again over it, the loaders for the new rank
        and world size, and the epoch's start restored."""
        session = self.session
        self.strategy = rebuild_strategy(self.strategy, Layout.from_group(self.device))
        self.model, self.optimizer = self.strategy.model, self.strategy.optimizer
        self.policy = self.strategy.policy
        if session.restore == Restore.CHECKPOINT:  # the session loads it into strategy.state
            # the best epoch's weights come from its checkpoint at the end, on every rank alike:
            # a newcomer has none in memory, and a shard of the old world fits no rank of this
            self.best_state = None
        elif self.start is not None and self.start[0] == epoch:
            self.start[1].restore(self.strategy)
        # else the epoch had not begun here: what this rank holds is its start already
        if session.restore == "peers":
            self._from_peers(newcomer=False)
        self.gathered = None  # of the old world: sent now, or of no use (a loss came first)
        self.train_data, self.valid_data = self._loaders()
        self.feed = self._feed()  # the new rank's share, put at the epoch's position when it runs
        return _WithRankState(self)


class _WithRankState:
    """The strategy's state, as a checkpoint holds it, with what only this rank holds: a
    stateful stream's position, kept in the rank's own file of the checkpoint."""

    def __init__(self, fitting: Fitting) -> None:
        self.fitting = fitting  # its strategy and feed, which a new world replaces

    @property
    def whole_on_root(self) -> bool:
        """Whole on rank 0 where the mode's state is: a rank's own part is in its own file."""
        return whole_on_root(self.fitting.strategy.state)

    def state_dict(self) -> dict[str, Any]:
        return self.fitting.strategy.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fitting.strategy.state.load_state_dict(state)

    def rank_state(self) -> dict[str, Any] | None:
        feed = self.fitting.feed
        return None if feed is None else feed.rank_state()

    def load_rank_state(self, saved: Any) -> None:
        if self.fitting.feed is not None:
            self.fitting.feed.load_rank_state(saved)
