"""Which modes :func:`~epochal.worker.training.train.fit` carries into a new world.

In an elastic run (``--min-workers`` below the world size) ``fit`` keeps a snapshot of the start of
every epoch (:class:`~epochal.worker.regroup.Snapshot`) and, when a rank is lost, builds its mode
again over the survivors' new process group and restores that snapshot: the epoch starts again,
at the new size, from exactly the values it started from; no file is read and no survivor
restarts. In ``replicated`` every rank's copy is whole; in ``main`` only rank 0 holds the
optimizer, so a world whose rank 0 was lost cannot go on from memory (the run ends, saying why).
The sharded modes keep a shard per rank, which a lost rank takes with it: ``fit`` does not carry
them into a new world in this version (:data:`ELASTIC_MODES`).
"""

from __future__ import annotations

from epochal.errors import ConfigError

ELASTIC_MODES = ("replicated", "main")
"""The modes whose ranks can go on without a lost rank: every rank's copy of an epoch's start
holds the whole model (and, but for ``main``'s other ranks, the whole optimizer)."""


def check_elastic_mode(mode: str) -> None:
    """Refuse, before any training, a mode that cannot go on without a lost rank."""
    if mode not in ELASTIC_MODES:
        raise ConfigError(
            f"mode {mode!r} keeps a shard of the state on each rank, which a lost rank takes "
            f"with it: the run cannot go on without one in this version. Use mode "
            f"{' or '.join(map(repr, ELASTIC_MODES))}, or run with --min-workers equal to the "
            "world size (a lost rank then ends the run, and --max-restarts resumes it from its "
            "last checkpoint)"
        )
