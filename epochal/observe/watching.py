"""The observers a run's settings ask for.

``--tensorboard DIR``, ``--metrics-address HOST:PORT`` and ``--no-status`` are settings of the run
(fields of :class:`~epochal.coordinator.config.CoordinatorConfig`, so ``epochal run`` and
``epochal coordinator`` both take them); ``from_config(config)`` returns the
:class:`~epochal.observe.observer.Observers` for one run (status.json and the learning curve by
default, the others when asked for). Their owner builds them once for all the attempts of a run
and closes them outside the event loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from epochal.log import COORDINATOR
from epochal.observe.curve import Curve
from epochal.observe.observer import Observers
from epochal.observe.prometheus import is_loopback
from epochal.observe.statusfile import StatusFile

if TYPE_CHECKING:
    from epochal.coordinator.config import CoordinatorConfig


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


def from_config(config: CoordinatorConfig) -> Observers:
    """:func:`build` from the run's settings (``--tensorboard``, ``--metrics-address``,
    ``--no-status``, declared on :class:`~epochal.coordinator.config.CoordinatorConfig`)."""
    return build(
        config.run_dir,
        tensorboard=config.tensorboard,
        metrics_address=config.metrics_address,
        status_file=config.status,
    )
