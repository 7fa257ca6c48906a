"""The coordinator's configuration: one frozen, validated dataclass for the CLI and the API."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from epochal.errors import ConfigError
from epochal.protocol.messages import DEFAULT_JOB, check_job_name

BatchPolicy = Literal["error", "truncate"]
BATCH_POLICIES: tuple[BatchPolicy, ...] = ("error", "truncate")
BACKEND_CHOICES = ("auto", "gloo", "nccl")


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
    finish_timeout: float = 30.0
    # seconds the coordinator waits for every worker's Done after Finish

    def __post_init__(self) -> None:
        for name in ("world_size", "epochs"):
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
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout} s) must exceed heartbeat_interval "
                f"({self.heartbeat_interval} s), or every worker would look dead"
            )
