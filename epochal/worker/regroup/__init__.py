"""The worker's data plane when the world changes size at an epoch boundary.

The coordinator decides each new world (who is in it, their ranks, a new store); the worker's
control loop follows it with these steps, each a small function of a strategy
(:mod:`epochal.worker.strategies`):

=================== ===================================================================
:class:`Snapshot`    at the start of each epoch: a host copy of the strategy's state and
                     the generators (:meth:`Snapshot.take`); after a loss, restores the
                     start of the epoch (:meth:`Snapshot.restore`) where the mode allows
                     (``Strategy.snapshot_scope``, ``SnapshotScope.restore_after``)
:func:`consolidate`  before leaving a group that admits a newcomer, in sharded modes: the
                     whole state onto rank 0's CPU
:func:`leave`        out of the old process group, so that its sockets close and peers
                     blocked in a collective with this rank raise
:func:`rebuild`      the same mode, options and precision over the new group, around the
                     same model object
:func:`share`        in the new group: every rank gets rank 0's model, optimizer and loss
                     scaler over the data plane (a newcomer reads no file, nobody unpickles)
=================== ===================================================================

Survivors of a lost rank: ``leave`` (with the collective's error), a new process group,
``rebuild``, then ``Snapshot.restore`` or the last checkpoint (``Checkpointer.load(epoch,
strategy.state, rng=False)`` and ``Snapshot.restore_generators``), and the epoch again. A world
that grows: ``consolidate``, ``leave``, a new group, ``rebuild`` (``wrap`` on the newcomer),
``share``. docs/elastic.md gives the calls in order, what each mode restores from, and what it
costs.
"""

from epochal.worker.regroup.leave import clear_frames, leave, rebuild
from epochal.worker.regroup.share import FullState, Transfer, consolidate, share, share_tree
from epochal.worker.regroup.snapshot import Snapshot

__all__ = [
    "FullState",
    "Snapshot",
    "Transfer",
    "clear_frames",
    "consolidate",
    "leave",
    "rebuild",
    "share",
    "share_tree",
]
