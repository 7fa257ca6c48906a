"""Epochal: distributed data-parallel training of PyTorch models with a separate control plane.

A coordinator (:mod:`epochal.coordinator`, no torch) holds the rendezvous and decides every
per-epoch question once for all ranks; workers (:mod:`epochal.worker`) embed in the training code
and move tensors among themselves over ``torch.distributed``; :mod:`epochal.protocol` is what they
say to each other. The worker API is imported lazily so ``import epochal`` (and the CLI) does not
pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from epochal.errors import (
    ConfigError,
    CoordinatorUnreachable,
    EpochalError,
    JoinRefused,
    MalformedMessage,
    RunAborted,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from epochal.coordinator.serve.background import start_coordinator
    from epochal.worker import (
        EpochContext,
        FitOptions,
        JoinOptions,
        LayeredModel,
        LossSum,
        ModeOptions,
        RunResult,
        Session,
        ShardSampler,
        TrainState,
        batches,
        fit,
        initialize_on_rank,
        join,
        train,
    )

_WORKER_NAMES = {
    "FitOptions",
    "JoinOptions",
    "LayeredModel",
    "ModeOptions",
    "initialize_on_rank",
    "EpochContext",
    "LossSum",
    "RunResult",
    "Session",
    "ShardSampler",
    "TrainState",
    "batches",
    "fit",
    "join",
    "train",
}


def __getattr__(name: str) -> Any:
    if name == "start_coordinator":  # zmq, not torch: still imported only when used
        from epochal.coordinator.serve.background import start_coordinator

        return start_coordinator
    if name in _WORKER_NAMES:
        import epochal.worker

        return getattr(epochal.worker, name)
    raise AttributeError(f"module 'epochal' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What ``dir(epochal)`` and completion show: the module's names and the lazily imported
    public API (``train``, ``join``, ...), which :func:`__getattr__` supplies on first use."""
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ConfigError",
    "CoordinatorUnreachable",
    "EpochContext",
    "EpochalError",
    "FitOptions",
    "JoinOptions",
    "JoinRefused",
    "LayeredModel",
    "LossSum",
    "MalformedMessage",
    "ModeOptions",
    "RunAborted",
    "RunResult",
    "Session",
    "ShardSampler",
    "TrainState",
    "__version__",
    "batches",
    "fit",
    "initialize_on_rank",
    "join",
    "start_coordinator",
    "train",
]
