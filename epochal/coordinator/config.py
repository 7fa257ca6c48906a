"""The coordinator's configuration: one frozen, validated dataclass for the CLI and the API."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from epochal.coordinator.schedule import Schedule, parse_schedule
from epochal.errors import ConfigError
from epochal.protocol.messages import DEFAULT_JOB, check_job_name

BatchPolicy = Literal["error", "truncate"]
BATCH_POLICIES: tuple[BatchPolicy, ...] = ("error", "truncate")
BACKEND_CHOICES = ("auto", "gloo", "nccl")

STALL_ABORT = 1200.0
"""The default ``stall_abort``, 20 minutes. Twice the workers' default collective timeout (600 s),
so a rank blocked in a collective ends with that timeout's own error first; long enough for what
legitimately shows no progress (a slow first step, a loader that downloads its data, a large
checkpoint); finite, so a rank stuck outside any collective, which nothing else ends, is ended and
named. Lower it to a few times the slowest step to have a hung rank named sooner."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """Everything the coordinator decides a run by."""

    world_size: int
    # number of workers the rendezvous waits for; exactly this many train
    epochs: int = 10
    # epochs to run (the last one is ``epochs - 1``)
    job: str = DEFAULT_JOB
    # workers that name another job are refused
    token: str = ""
    # shared secret every hello must carry; empty: none required
    batch_policy: BatchPolicy = "error"
    # unequal batch counts: "error" aborts naming each rank's count, "truncate" runs the minimum
    smoothing: float = 1.0
    # a in s = a*raw + (1-a)*s_prev over the validation loss; 1.0 is no smoothing
    validation_frequency: int = 1
    # validate on epoch 0 and every K-th epoch after it
    lr_schedule: str = "constant"
    # learning-rate schedule spec (see epochal.coordinator.schedule); a factor <= 0 stops the run
    patience: int | None = None
    # stop once more than this many validated epochs in a row fail to improve; None: never
    min_delta: float = 0.0
    # an improvement must lower the best smoothed loss by more than this to reset the patience
    best_from: int = 0
    # epochs before this one cannot become the best epoch
    restore_best: bool = True
    # workers load the best epoch's weights at the end (else they keep the last epoch's)
    checkpoint_every: int = 1
    # workers checkpoint every K-th epoch (and the last); 0: never
    keep_checkpoints: int = 2
    # how many of the most recent checkpoints to keep (the best one is always kept)
    checkpoint_dir: Path | None = None
    # where workers write checkpoints (all ranks must see it); None: RUN_DIR/checkpoints
    backend: str = "auto"
    # data-plane backend: "auto" picks nccl when every worker has CUDA, else gloo
    run_dir: Path | None = None
    # where run.json and epochs.jsonl go; None: nothing is written
    rendezvous_timeout: float = 300.0
    # seconds from start for all ``world_size`` workers to join before the run is aborted
    store_timeout: float = 60.0
    # seconds rank 0 has to open the data-plane store and report its port
    heartbeat_interval: float = 1.0
    # seconds between heartbeats the coordinator sends each worker
    heartbeat_timeout: float = 15.0
    # seconds of silence after which a worker is declared lost and the run aborted
    stall_timeout: float = 300.0
    # seconds without progress on any rank after which the coordinator prints where each rank is
    stall_abort: float | None = STALL_ABORT
    # seconds without progress on any rank after which the run is aborted, naming the rank the
    # others wait for (liveness.culprit); None: never. It ends hangs that no timeout ends (a rank
    # stuck outside any collective, e.g. in its validation loader, while the others wait)
    finish_timeout: float = 30.0
    # seconds the coordinator waits for every worker's Done after Finish
    command: tuple[str, ...] | None = None
    # the workers' script (absolute) and its arguments, when epochal starts them (epochal run): a
    # resume with other arguments (--seed, --lr, ...) is refused. None: not known
    script_digest: str | None = None
    # SHA-256 of the workers' script file, for the same check; None: not known

    def __post_init__(self) -> None:
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
        if self.validation_frequency < 1:
            raise ConfigError(
                "validation frequency must be >= 1 (1 = every epoch), "
                f"got {self.validation_frequency}"
            )
        parse_schedule(self.lr_schedule, self.epochs)  # raises ConfigError naming the problem
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
        if self.backend not in BACKEND_CHOICES:
            raise ConfigError(
                f"backend {self.backend!r} is unknown: use one of {', '.join(BACKEND_CHOICES)}"
            )
        for name in (
            "rendezvous_timeout",
            "store_timeout",
            "heartbeat_interval",
            "heartbeat_timeout",
            "finish_timeout",
            "stall_timeout",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if self.command is not None and not all(isinstance(a, str) for a in self.command):
            raise ConfigError(f"command must be a sequence of strings, got {self.command!r}")
        if self.stall_abort is not None and not (
            self.stall_abort > 0 and math.isfinite(self.stall_abort)
        ):
            raise ConfigError(
                f"stall_abort must be a positive number of seconds (None: never), "
                f"got {self.stall_abort}"
            )
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout} s) must exceed heartbeat_interval "
                f"({self.heartbeat_interval} s), or every worker would look dead"
            )

    @property
    def checkpoint_path(self) -> Path | None:
        """Where checkpoints go, absolute; None when there is nowhere to put them."""
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir.absolute()
        if self.run_dir is not None:
            return (self.run_dir / "checkpoints").absolute()
        return None

    @property
    def schedule(self) -> Schedule:
        """The parsed learning-rate schedule."""
        return parse_schedule(self.lr_schedule, self.epochs)

    def validates(self, epoch: int) -> bool:
        """Whether ``epoch`` is a validation epoch (epoch 0 and every K-th)."""
        return epoch % self.validation_frequency == 0

    def checkpoints(self, epoch: int, last: bool) -> bool:
        """Whether workers checkpoint after ``epoch`` (every K-th, and the last, when enabled)."""
        every = self.checkpoint_every
        return every > 0 and (last or (epoch + 1) % every == 0)
