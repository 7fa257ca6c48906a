"""The command-line options that switch observers on, and the observers they make.

``add_arguments(parser)`` adds ``--tensorboard DIR``, ``--metrics-address HOST:PORT`` and
``--no-status``; ``from_args(args, run_dir)`` returns the :class:`~epochal.observe.base.Observers`
for one run (status.json and the learning curve by default, the others when asked for).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from epochal.log import COORDINATOR
from epochal.observe.base import Observers
from epochal.observe.curve import Curve
from epochal.observe.prometheus import is_loopback, parse_address
from epochal.observe.statusfile import StatusFile


def _address(text: str) -> str:
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("watching the run")
    g.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        metavar="DIR",
        help="write every journaled scalar per epoch as TensorBoard events to DIR/RUN_NAME "
        "(needs the tensorboard extra: pip install 'epochal[tensorboard]')",
    )
    g.add_argument(
        "--metrics-address",
        type=_address,
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (PORT alone: on loopback)",
    )
    g.add_argument(
        "--no-status",
        dest="status_file",
        action="store_false",
        help="do not keep RUN_DIR/status.json (read by `epochal status`) or draw "
        "RUN_DIR/curve.png at the end",
    )


def build(
    run_dir: Path | None,
    *,
    tensorboard: Path | None = None,
    metrics_address: str | None = None,
    status_file: bool = True,
) -> Observers:
    """The observers of one run. Raises ConfigError (a missing extra) or OSError (the metrics
    port cannot be bound) before the run starts, so a mistake is a usage error, not a surprise
    at the first epoch."""
    observers = Observers()
    try:
        if status_file and run_dir is not None:
            observers.add(StatusFile(run_dir))
            observers.add(Curve(run_dir))
        if tensorboard is not None:
            from epochal.observe.tensorboard import TensorBoard

            observers.add(TensorBoard(tensorboard))
        if metrics_address is not None:
            from epochal.observe.prometheus import Prometheus

            metrics = Prometheus(metrics_address)
            observers.add(metrics)
            if not is_loopback(metrics.host):
                COORDINATOR.info(f"metrics at {metrics.url}, reachable from other machines")
    except BaseException:
        observers.close()
        raise
    return observers


def from_args(args: argparse.Namespace, run_dir: Path | None) -> Observers:
    """:func:`build` from the options :func:`add_arguments` added."""
    return build(
        run_dir,
        tensorboard=getattr(args, "tensorboard", None),
        metrics_address=getattr(args, "metrics_address", None),
        status_file=getattr(args, "status_file", True),
    )
