"""The coordinator service's file work off its event loop: old checkpoints deleted, observers told.

:class:`Upkeep` holds the service's two :class:`~.diskwork.DiskWork` threads, one that deletes the
checkpoints a commit pruned and one that tells the observers (status.json, TensorBoard, metrics)
in order, and the one point where their failures are said (:meth:`Upkeep.say_failures`, once a
turn of the service's loop). At the run's end :meth:`Upkeep.finish` waits for both, bounded by
:data:`~.diskwork.DRAIN_TIMEOUT`, and says what failed and what is still going.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from pathlib import Path

from epochal.coordinator.serve import diskwork
from epochal.observe import Observers, RunObserver
from epochal.rundir.manifest import checkpoint_path


class Upkeep:
    """The service's disk work; see the module docstring. ``observers``: told off the loop
    (an empty set when None); ``log``: where failures are said."""

    def __init__(self, observers: RunObserver | None, log: Callable[[str], None]) -> None:
        self._log = log
        self._pruning = diskwork.DiskWork("epochal-prune")
        self._observing = diskwork.DiskWork("epochal-observers")
        self.observers: RunObserver = diskwork.OffLoop(
            observers if observers is not None else Observers(), self._observing
        )
        # what the service tells: every call handed to the observers' thread, in order

    def prune(self, checkpoint_dir: Path, epochs: Iterable[int]) -> None:
        """Delete the checkpoints of ``epochs`` under ``checkpoint_dir``, off the loop."""
        for old in epochs:
            path = checkpoint_path(checkpoint_dir, old)
            self._pruning.submit(
                f"deleting the checkpoint of epoch {old} ({path})",
                functools.partial(diskwork.delete_tree, path),
            )

    def say_failures(self) -> None:
        """Log what the disk work could not do, each failure once (see :mod:`.diskwork`)."""
        for work in (self._pruning, self._observing):
            for line in work.take_failures():
                self._log(f"{line} (the run goes on)")

    async def finish(self) -> None:
        """Before the run is reported done: wait for the old checkpoints being deleted and the
        observers being told, at most :data:`~.diskwork.DRAIN_TIMEOUT` seconds, and say what
        failed and what is still going."""
        timeout = diskwork.DRAIN_TIMEOUT
        works = (self._pruning, self._observing)
        left = await asyncio.gather(*(work.drain(timeout) for work in works))
        self.say_failures()
        for work in works:
            for line in work.repeats():
                self._log(line)
        undone = [what for whats in left for what in whats]
        if undone:
            self._log(
                f"not done {timeout:g} s after the run ended: {'; '.join(undone)}; the run ends "
                "without waiting longer (a checkpoint not deleted is left for you to delete)"
            )
