"""Observers of a run: status.json, the learning curve, TensorBoard events, Prometheus metrics.

The coordinator feeds an :class:`Observers` fan-out (start, joins, every journal record with a
status snapshot, a snapshot every heartbeat interval, the end); each sink lives in its own module
and imports its library (matplotlib, tensorboard, prometheus-client) only when it is switched on.
Nothing here imports torch.
"""

from epochal.observe.observer import (
    Observers,
    RankStatus,
    RunObserver,
    RunStart,
    StatusSnapshot,
    World,
)

__all__ = ["Observers", "RankStatus", "RunObserver", "RunStart", "StatusSnapshot", "World"]
