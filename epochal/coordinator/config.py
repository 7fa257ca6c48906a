"""The coordinator's configuration: one frozen, validated dataclass for the CLI and the API.

The command line's run options are generated from its fields (:mod:`epochal.cli.settings`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from epochal.cli.argtypes import (
    address_arg,
    nonnegative_int,
    positive_int,
    seconds,
    seconds_or_never,
)
from epochal.cli.settings import (
    CHECKPOINTS,
    FAILURES,
    RUN_POLICY,
    TIMEOUTS,
    WATCHING,
    Flag,
    setting,
)
from epochal.coordinator.configchecks import check_processes
from epochal.coordinator.monitoring import check_monitor, monitor_arg
from epochal.coordinator.rules.schedule import Schedule, parse_schedule
from epochal.environment import DEFAULT_COLLECTIVE_TIMEOUT
from epochal.errors import ConfigError
from epochal.protocol.messages import (
    DEFAULT_JOB,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    Liveness,
    check_job_name,
)
from epochal.rundir.paths import CHECKPOINTS_DIR

BatchPolicy = Literal["error", "truncate"]
BATCH_POLICIES: tuple[BatchPolicy, ...] = ("error", "truncate")
BACKEND_CHOICES = ("auto", "gloo", "nccl")
MonitorMode = Literal["min", "max"]
MONITOR_MODES: tuple[MonitorMode, ...] = ("min", "max")


STALL_ABORT = 2 * DEFAULT_COLLECTIVE_TIMEOUT
"""The default ``stall_abort``, 20 minutes: twice the workers' default collective timeout (600 s),
so a rank blocked in a collective ends with that timeout's own error first; long enough for what
legitimately shows no progress (a slow first step, a loader that downloads its data, a large
checkpoint); finite, so a rank stuck outside any collective, which nothing else ends, is ended and
named. Lower it to a few times the slowest step to have a hung rank named sooner."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """Everything the coordinator decides a run by.

    Each field is documented once, in its :func:`~epochal.cli.settings.setting`: the help the
    command line shows (and the options table in docs/cli.md repeats, checked by a test), the flag
    and its value type, and whether a resumed run may change it.
    """

    world_size: int = field(
        metadata=setting(
            help="number of workers the rendezvous waits for: the size the run starts at and the "
            "most it admits",
            # a resume at another size (fewer machines left, or more) reshards the checkpoint and
            # says so: with a fixed global batch it trains the same steps, up to float rounding
            on_resume="may_change",
            called="--world-size/--nproc",
        ),
    )
    min_workers: int | None = field(
        default=None,
        metadata=setting(
            help="the fewest workers the run goes on with: a lost worker's peers carry on from "
            "the start of the interrupted epoch while at least M remain",
            on_resume="may_change",
            flag=Flag(FAILURES, metavar="M", type=positive_int, shown="the world size"),
        ),
    )
    replica_check: bool = field(
        default=True,
        metadata=setting(
            help="do not compare a checksum of every rank's weights after each epoch; by default "
            "the run aborts, naming the ranks, when ranks that should hold the same model "
            "(modes replicated and main) do not, as a training loop without DDP would",
            on_resume="may_change",
            flag=Flag(FAILURES, negated=True),
        ),
    )
    epochs: int = field(
        default=10,
        metadata=setting(
            help="epochs to train, numbered from 0; more than a resumed run had trains it "
            "further (also one that finished), fewer is refused",
            on_resume="may_grow",  # its schedule is stretched over the new count from then on
            flag=Flag(RUN_POLICY, metavar="E", type=positive_int),
        ),
    )
    steps_per_epoch: int | None = field(
        default=None,
        metadata=setting(
            help="an epoch is N global optimizer steps, whatever a pass over the data holds: "
            "validation, checkpoints and every decision come every N steps, and the data goes on "
            "where the last epoch left it",
            flag=Flag(RUN_POLICY, metavar="N", type=positive_int, shown="one pass"),
        ),
    )
    job: str = field(
        default=DEFAULT_JOB,
        metadata=setting(
            help="job name; workers naming another job are refused",
            flag=Flag(RUN_POLICY, metavar="NAME"),
        ),
    )
    token: str = field(
        default="",
        metadata=setting(
            help="shared secret every hello must carry (EPOCHAL_TOKEN); empty: none required",
            on_resume="may_change",
        ),
    )
    batch_policy: BatchPolicy = field(
        default="error",
        metadata=setting(
            help="unequal batch counts across ranks: abort naming each rank's count (error) or run "
            "the minimum (truncate)",
            flag=Flag(RUN_POLICY, choices=BATCH_POLICIES),
        ),
    )
    smoothing: float = field(
        default=1.0,
        metadata=setting(
            help="smoothing factor A in (0, 1] of the monitored value (--monitor; the validation "
            "loss by default): s = A*value + (1-A)*s_prev; 1.0 is no smoothing",
            flag=Flag(RUN_POLICY, metavar="A", type=float, shown="1.0"),
        ),
    )
    monitor: str = field(
        default="loss",
        metadata=setting(
            help="what picks the best epoch, early stopping and the plateau schedule: loss, or "
            "the name of a metric the workers report (train(metrics=...)); of the validation "
            "split when the run validates, else of the training split",
            flag=Flag(RUN_POLICY, metavar="NAME", type=monitor_arg),
            on_resume="when_known",  # a run recorded before it existed monitored the loss (min)
        ),
    )
    monitor_mode: MonitorMode = field(
        default="min",
        metadata=setting(
            help="whether a lower (min: a loss) or higher (max: an accuracy, so --monitor "
            "accuracy wants max) monitored value is better",
            flag=Flag(RUN_POLICY, choices=MONITOR_MODES),
            on_resume="when_known",  # a run recorded before it existed monitored the loss (min)
        ),
    )
    validation_frequency: int = field(
        default=1,
        metadata=setting(
            help="validate on epoch 0 and every K-th epoch",
            flag=Flag(RUN_POLICY, metavar="K", type=positive_int),
        ),
    )
    lr_schedule: str = field(
        default="constant",
        metadata=setting(
            help="learning-rate factor schedule: constant, step:every=N,gamma=G, "
            "exponential:gamma=G, cosine:min=M, linear:end=E, "
            "plateau:patience=P,factor=F,threshold=T,min=M, or per optimizer step "
            "warmup-cosine:warmup=W,steps=S,min=M; a factor <= 0 stops the run",
            flag=Flag(RUN_POLICY, metavar="SPEC"),
        ),
    )
    keep_schedule: bool = field(
        default=False,
        metadata=setting(
            help="when a resume gives the run more --epochs, keep a schedule that spans them "
            "(cosine) on its curve over the epochs it had, and hold its last factor for those "
            "added, where it would continue on the curve over the new count",
            on_resume="may_change",
            flag=Flag(RUN_POLICY),
        ),
    )
    patience: int | None = field(
        default=None,
        metadata=setting(
            help="stop early once more than P validated epochs in a row bring no improvement "
            "of the smoothed monitored value",
            on_resume="steers",  # early stopping from the resumed epoch on
            flag=Flag(RUN_POLICY, metavar="P", type=nonnegative_int, shown="never"),
        ),
    )
    min_delta: float = field(
        default=0.0,
        metadata=setting(
            help="an improvement must better the best smoothed monitored value by more than D: "
            "lower it under --monitor-mode min, raise it under max",
            on_resume="steers",  # what counts as an improvement from then on
            flag=Flag(RUN_POLICY, metavar="D", type=float),
        ),
    )
    best_from: int = field(
        default=0,
        metadata=setting(
            help="epochs before EPOCH cannot become the best epoch",
            flag=Flag(RUN_POLICY, metavar="EPOCH", type=nonnegative_int),
        ),
    )
    restore_best: bool = field(
        default=True,
        metadata=setting(
            help="end with the last epoch's weights instead of the best epoch's",
            flag=Flag(RUN_POLICY, negated=True),
        ),
    )
    checkpoint_every: int = field(
        default=1,
        metadata=setting(
            help="checkpoint every K-th epoch, the best one and the last; 0: never",
            on_resume="steers",  # which epochs still to come are saved
            flag=Flag(CHECKPOINTS, metavar="K", type=nonnegative_int),
        ),
    )
    keep_checkpoints: int = field(
        default=2,
        metadata=setting(
            help="keep the N newest checkpoints plus the best one",
            on_resume="may_change",
            flag=Flag(CHECKPOINTS, metavar="N", type=positive_int),
        ),
    )
    checkpoint_dir: Path | None = field(
        default=None,
        metadata=setting(
            help="where workers write checkpoints; every rank must see it; yours alone (a "
            "directory another user could write in is refused); epochal run makes it and tries "
            "writing in it before any worker starts",
            flag=Flag(CHECKPOINTS, metavar="DIR", type=Path, shown="RUN_DIR/checkpoints"),
        ),
    )
    backend: str = field(
        default="auto",
        metadata=setting(
            help="data-plane backend: auto picks nccl when every worker has CUDA, else gloo",
            on_resume="may_change",
            flag=Flag(RUN_POLICY, choices=BACKEND_CHOICES),
        ),
    )
    run_dir: Path | None = field(
        default=None,
        metadata=setting(
            help="directory for run.json, epochs.jsonl, result.json, model.json and checkpoints "
            "(said at the start); a directory that holds an unfinished run resumes it; created "
            "0700, and refused before the run starts if another user could write in it or you "
            "cannot",
            on_resume="may_change",
            flag=Flag(CHECKPOINTS, metavar="DIR", type=Path, shown="runs/RUN_ID"),
        ),
    )
    # the command line's default is runs/RUN_ID; None (the API's): nothing is written
    rendezvous_timeout: float = field(
        default=300.0,
        metadata=setting(
            help="time for every worker to join before the run is aborted",
            on_resume="may_change",
            flag=Flag(TIMEOUTS, metavar="S", type=seconds),
        ),
    )
    store_timeout: float = field(
        default=60.0,
        metadata=setting(
            help="seconds rank 0 has to open the data-plane store and report its port",
            on_resume="may_change",
        ),
    )
    heartbeat_interval: float = field(
        default=HEARTBEAT_INTERVAL,
        metadata=setting(
            help="time between two heartbeats, the coordinator's to each worker and each "
            "worker's to the coordinator (the workers take the run's value)",
            on_resume="may_change",
            flag=Flag(TIMEOUTS, metavar="S", type=seconds),
        ),
    )
    heartbeat_timeout: float = field(
        default=HEARTBEAT_TIMEOUT,
        metadata=setting(
            help="silence after which a worker is declared lost (and the coordinator, by the "
            "workers, which take the run's value); also how long a connection may stay open "
            "without joining the run before it is closed",
            on_resume="may_change",
            flag=Flag(TIMEOUTS, metavar="S", type=seconds),
        ),
    )
    stall_timeout: float = field(
        default=300.0,
        metadata=setting(
            help="when no rank has made progress for S seconds, print where each rank is",
            on_resume="may_change",
            flag=Flag(TIMEOUTS, metavar="S", type=seconds),
        ),
    )
    stall_abort: float | None = field(
        default=STALL_ABORT,
        metadata=setting(
            help="when no rank has made progress for S seconds, abort the run naming the rank "
            "the others wait for; 0: never. The default is twice the workers' collective timeout",
            on_resume="may_change",
            flag=Flag(TIMEOUTS, metavar="S", type=seconds_or_never),
        ),
    )
    # it ends hangs that no timeout ends (a rank stuck outside any collective, e.g. in its
    # validation loader, while the others wait); see liveness.culprit and STALL_ABORT
    finish_timeout: float = field(
        default=30.0,
        metadata=setting(
            help="seconds the coordinator waits for every worker's Done after Finish",
            on_resume="may_change",
        ),
    )
    command: tuple[str, ...] | None = field(
        default=None,
        metadata=setting(
            help="the workers' script (absolute) and its arguments, when epochal starts them "
            "(epochal run), so that a resume with other arguments (--seed, --lr, ...) is refused; "
            "None: not known",
            on_resume="when_known",
            called="the workers' command line",
        ),
    )
    script_digest: str | None = field(
        default=None,
        metadata=setting(
            help="SHA-256 of the workers' script file, for the same check; None: not known",
            on_resume="when_known",
            called="the script's SHA-256",
        ),
    )

    tensorboard: Path | None = field(
        default=None,
        metadata=setting(
            help="write every journaled scalar per epoch as TensorBoard events to DIR/RUN_NAME "
            "(created 0700; needs the tensorboard extra: pip install 'epochal[tensorboard]')",
            on_resume="may_change",
            flag=Flag(WATCHING, metavar="DIR", type=Path, shown="none"),
        ),
    )
    metrics_address: str | None = field(
        default=None,
        metadata=setting(
            help="serve Prometheus metrics at http://HOST:PORT/metrics (PORT alone: on loopback)",
            on_resume="may_change",
            flag=Flag(WATCHING, metavar="HOST:PORT", type=address_arg, shown="none"),
        ),
    )
    status: bool = field(
        default=True,
        metadata=setting(
            help="do not keep RUN_DIR/status.json (read by `epochal status`) or draw "
            "RUN_DIR/curve.png at the end",
            on_resume="may_change",
            flag=Flag(WATCHING, negated=True),
        ),
    )

    def __post_init__(self) -> None:
        self._check_training()
        check_processes(self, BACKEND_CHOICES)

    def _check_training(self) -> None:
        for name in (
            "world_size",
            "epochs",
            "validation_frequency",
            "best_from",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            value = getattr(self, name)
            if type(value) is not int:
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {self.world_size}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        steps = self.steps_per_epoch
        if steps is not None and (type(steps) is not int or steps < 1):
            raise ConfigError(f"steps_per_epoch must be a whole number >= 1, got {steps!r}")
        try:
            check_job_name(self.job)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.batch_policy not in BATCH_POLICIES:
            raise ConfigError(
                f"batch policy {self.batch_policy!r} is unknown: "
                f"use one of {', '.join(BATCH_POLICIES)}"
            )
        if not (0.0 < self.smoothing <= 1.0) or math.isnan(self.smoothing):
            raise ConfigError(
                f"smoothing factor must be in (0, 1] (1.0 = no smoothing), got {self.smoothing}"
            )
        check_monitor(self.monitor)
        if self.monitor_mode not in MONITOR_MODES:
            raise ConfigError(
                f"monitor mode {self.monitor_mode!r} is unknown: use one of "
                f"{', '.join(MONITOR_MODES)}"
            )
        if self.validation_frequency < 1:
            raise ConfigError(
                "validation frequency must be >= 1 (1 = every epoch), "
                f"got {self.validation_frequency}"
            )
        parse_schedule(self.lr_schedule, self.epochs, steps)  # raises ConfigError saying why
        if self.patience is not None and (type(self.patience) is not int or self.patience < 0):
            raise ConfigError(f"patience must be a whole number >= 0, got {self.patience!r}")
        if not (self.min_delta >= 0 and math.isfinite(self.min_delta)):
            raise ConfigError(f"min_delta must be a finite number >= 0, got {self.min_delta}")
        if self.best_from < 0:
            raise ConfigError(f"best_from must be an epoch >= 0, got {self.best_from}")
        if self.checkpoint_every < 0:
            raise ConfigError(
                f"checkpoint_every must be >= 0 (0 = never), got {self.checkpoint_every}"
            )
        if self.keep_checkpoints < 1:
            raise ConfigError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")

    @property
    def checkpoint_path(self) -> Path | None:
        """Where checkpoints go, absolute; None when there is nowhere to put them."""
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir.absolute()
        if self.run_dir is not None:
            return (self.run_dir / CHECKPOINTS_DIR).absolute()
        return None

    @property
    def least_workers(self) -> int:
        """The fewest workers the run goes on with (``--min-workers``, else the world size)."""
        return self.world_size if self.min_workers is None else self.min_workers

    @property
    def elastic(self) -> bool:
        """Whether the run goes on when it loses a worker."""
        return self.least_workers < self.world_size

    @property
    def liveness(self) -> Liveness:
        """The run's heartbeat interval and timeout, as every worker is told them."""
        return Liveness(interval=self.heartbeat_interval, timeout=self.heartbeat_timeout)

    @property
    def schedule(self) -> Schedule:
        """The parsed learning-rate schedule."""
        return parse_schedule(self.lr_schedule, self.epochs, self.steps_per_epoch)

    def validates(self, epoch: int) -> bool:
        """Whether ``epoch`` is a validation epoch (epoch 0 and every K-th)."""
        return epoch % self.validation_frequency == 0

    def checkpoints(self, epoch: int, last: bool) -> bool:
        """Whether workers checkpoint after ``epoch`` (every K-th, and the last, when enabled)."""
        every = self.checkpoint_every
        return every > 0 and (last or (epoch + 1) % every == 0)
