"""How :func:`~epochal.worker.training.train.fit` carries its state into a new world.

In an elastic run (``--min-workers`` below the world size) ``fit`` keeps a copy of the start of
every epoch (:class:`~epochal.worker.regroup.Snapshot`) where its mode's copy holds the whole state
(``replicated``; ``main`` while rank 0 lives): when a rank is lost, the survivors build the mode
again over their new process group and restore that copy, so the epoch starts again at the new
size from exactly the values it started from; no file is read and no survivor restarts. The
sharded modes keep a shard per rank, which a lost rank takes with it; they, and a run whose copies
are switched off (``fit(snapshot=False)``), restore the last committed checkpoint instead, which
DCP reshards to the new size, and redo the epochs after it. The coordinator decides which, from
what each rank's ``epoch_ready`` says its copy holds (:class:`~epochal.protocol.SnapshotScope`).
"""

from __future__ import annotations

from epochal.errors import ConfigError
from epochal.protocol import SnapshotScope


def elastic_scope(
    mode: str, mode_scope: SnapshotScope, *, snapshot: bool, checkpoints: bool
) -> SnapshotScope:
    """What this rank's copy of each epoch's start holds in an elastic run; ConfigError, before
    any training, when a lost rank could not be recovered from: no whole copy and no checkpoint
    directory."""
    scope = mode_scope if snapshot else SnapshotScope.OFF
    if scope in (SnapshotScope.SHARD, SnapshotScope.OFF) and not checkpoints:
        why = (
            f"mode {mode!r} keeps a shard of the state on each rank, which a lost rank takes "
            "with it"
            if snapshot
            else "snapshot=False keeps no copy of an epoch's start"
        )
        raise ConfigError(
            f"{why}: this elastic run's survivors would restore the last checkpoint, but the run "
            "has no checkpoint directory. Give the run a --run-dir or --checkpoint-dir, or run "
            "with --min-workers equal to the world size"
        )
    return scope
