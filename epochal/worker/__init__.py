"""The worker API users embed in their training code: control client plus data plane.

Synchronous, as training scripts are written: :func:`train` for the common case,
:func:`join` and :meth:`Session.run_epochs` for custom loops. It never decides anything all ranks
must agree on: it asks the coordinator.
"""

from epochal.worker.checkpoints.state import TrainState
from epochal.worker.join import join
from epochal.worker.joinoptions import JoinOptions
from epochal.worker.session import Session
from epochal.worker.strategies import MODES, ModeOptions, Strategy, wrap
from epochal.worker.training.initialization import initialize_on_rank
from epochal.worker.training.passes import batches
from epochal.worker.training.placement import LayeredModel
from epochal.worker.training.results import EpochContext, EpochRecord, LossSum, RunResult
from epochal.worker.training.sharding import ShardSampler
from epochal.worker.training.train import FitOptions, fit, train

__all__ = [
    "MODES",
    "EpochContext",
    "EpochRecord",
    "FitOptions",
    "JoinOptions",
    "LayeredModel",
    "LossSum",
    "ModeOptions",
    "RunResult",
    "Session",
    "ShardSampler",
    "Strategy",
    "TrainState",
    "batches",
    "fit",
    "initialize_on_rank",
    "join",
    "train",
    "wrap",
]
