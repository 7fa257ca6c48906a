"""The worker API users embed in their training code: control client plus data plane.

Synchronous, as training scripts are written: :func:`train` for the common case,
:func:`join` and :meth:`Session.run_epochs` for custom loops. It never decides anything all ranks
must agree on: it asks the coordinator.
"""

from epochal.worker.session import (
    EpochContext,
    EpochRecord,
    LossSum,
    RunResult,
    Session,
    join,
)
from epochal.worker.sharding import ShardSampler
from epochal.worker.train import TrainState, fit, train

__all__ = [
    "EpochContext",
    "EpochRecord",
    "LossSum",
    "RunResult",
    "Session",
    "ShardSampler",
    "TrainState",
    "fit",
    "join",
    "train",
]
