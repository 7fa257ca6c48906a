"""What ``--monitor`` may name: ``loss`` or a metric name the workers report, checked once for
the command line and the configuration alike."""

from __future__ import annotations

import argparse

from epochal.errors import ConfigError
from epochal.protocol.messages import check_metric_name


def check_monitor(name: str) -> str:
    """``name`` if ``--monitor`` may name it (``loss`` or a metric name), else ConfigError."""
    if name == "loss":
        return name
    try:
        return check_metric_name(name)
    except ValueError as exc:
        raise ConfigError(f"--monitor {name!r}: {exc}") from None


def monitor_arg(text: str) -> str:
    """A name ``--monitor`` may take (:func:`check_monitor`)."""
    try:
        return check_monitor(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
