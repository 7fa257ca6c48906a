"""The coordinator: rendezvous, per-epoch policy, liveness and the run journal.

An asyncio service around pure decision logic. It imports the protocol, zmq and the standard
library, never torch, so it starts in well under a second on a machine without a GPU.
"""

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.serve.service import Coordinator, RunSummary

__all__ = ["Coordinator", "CoordinatorConfig", "RunSummary"]
