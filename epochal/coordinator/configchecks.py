"""The checks of a coordinator's configuration that concern its processes and the clock: the
backend, every timeout, the command, the metrics address. Each raises ConfigError naming the
setting and what it takes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from epochal.cli.argtypes import parse_address
from epochal.errors import ConfigError

if TYPE_CHECKING:
    from epochal.coordinator.config import CoordinatorConfig


def check_processes(config: CoordinatorConfig, backends: Sequence[str]) -> None:
    """Raise ConfigError for the first of ``config``'s process and timeout settings that is
    wrong; ``backends``: the backends it may name."""
    if config.min_workers is not None and not 1 <= config.min_workers <= config.world_size:
        raise ConfigError(
            f"--min-workers {config.min_workers} must be between 1 and the world size "
            f"({config.world_size})"
        )
    if config.backend not in backends:
        raise ConfigError(
            f"backend {config.backend!r} is unknown: use one of {', '.join(backends)}"
        )
    for name in (
        "rendezvous_timeout",
        "store_timeout",
        "heartbeat_interval",
        "heartbeat_timeout",
        "finish_timeout",
        "stall_timeout",
    ):
        value = getattr(config, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
    if config.command is not None and not all(isinstance(a, str) for a in config.command):
        raise ConfigError(f"command must be a sequence of strings, got {config.command!r}")
    if config.stall_abort is not None and not (
        config.stall_abort > 0 and math.isfinite(config.stall_abort)
    ):
        raise ConfigError(
            f"stall_abort must be a positive number of seconds (None: never), "
            f"got {config.stall_abort}"
        )
    if config.metrics_address is not None:
        parse_address(config.metrics_address)  # raises ConfigError naming the form it needs
    if config.heartbeat_timeout <= config.heartbeat_interval:
        raise ConfigError(
            f"heartbeat_timeout ({config.heartbeat_timeout} s) must exceed heartbeat_interval "
            f"({config.heartbeat_interval} s), or every worker would look dead"
        )
