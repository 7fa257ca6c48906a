"""What ``--monitor`` may name: ``loss``, or the name of a metric the training code reports.

The check is shared by the configuration (:class:`~.config.CoordinatorConfig`) and its command
line option, so that both refuse a name with the same reason."""

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
    """What ``--monitor`` may name (:func:`check_monitor`), as a command-line option's type."""
    try:
        return check_monitor(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
