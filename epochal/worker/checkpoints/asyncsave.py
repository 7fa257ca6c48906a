"""A checkpoint written while the next epoch trains: a host copy of the state, and the thread
that writes and commits it.

:meth:`~epochal.worker.checkpoints.checkpoint.Checkpointer.save_behind` takes the copy at the
epoch boundary, on the main thread, and hands rank 0's writing to a :class:`BackgroundSave`, which
tells the coordinator of the commit from its thread as soon as the rename is durable (the
exchange's :meth:`~epochal.worker.sessionparts.exchange.Exchange.committed`, safe from a second
thread). The session's :class:`~epochal.worker.sessionparts.savepoints.Savepoints` joins the
thread at the next defined point (the next boundary, a new world, a resume, the run's end) and
raises its error there. The thread runs no collective: gloo collectives on one group from two
threads interleave and deadlock, so everything collective happened on the main thread before it
starts.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

SINGLE_PROCESS_NOTE = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    r"save in a single process"
)
"""The warning DCP's ``save(..., no_dist=True)`` gives at every call: rank 0's one-rank write
asks for exactly that, so it is no news to the user."""


def quiet_single_process_note() -> None:
    """Leave out DCP's :data:`SINGLE_PROCESS_NOTE`. Called on the main thread before a writer
    starts, never while one runs: the filter list is the process's, and not locked."""
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTE, category=UserWarning)


def host_copy(value: Any, check: Callable[[torch.Tensor], None] | None = None) -> Any:
    """``value`` (a state dict: nested dicts, lists and tuples of tensors and plain data) with
    every tensor copied to host memory, so that training may change the originals meanwhile;
    ``check``, where given, sees each tensor first and may refuse it by raising."""
    if isinstance(value, torch.Tensor):
        if check is not None:
            check(value)
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v, check) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [host_copy(v, check) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return copy.deepcopy(value)


class BackgroundSave:
    """Rank 0's write and commit of ``epoch``'s checkpoint, running on its own thread.

    ``write`` writes and commits; then ``then(epoch)``, on the thread, says the commit (the
    coordinator hears of it while the next epoch trains). An error of either is kept, never
    raised on the thread, and raised once by :meth:`wait` on the thread that waits: the run then
    fails as it would have had the checkpoint been written synchronously.
    """

    def __init__(
        self,
        epoch: int,
        write: Callable[[], None],
        then: Callable[[int], None] | None = None,
    ) -> None:
        self.epoch = epoch
        self._write = write
        self._then = then
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"epochal-checkpoint-{epoch}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
            if self._then is not None:
                self._then(self.epoch)
        except BaseException as exc:  # kept for wait(), the one place it is acted on
            self._error = exc

    def wait(self) -> None:
        """Block until the write is done; its error, if it failed."""
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def drain(self) -> None:
        """Block until the write is done, its outcome dropped: the run is failing already, for
        another reason, and that one is what it reports."""
        self._thread.join()
        self._error = None
