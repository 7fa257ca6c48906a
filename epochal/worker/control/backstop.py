"""The control client's backstop: a worker whose training code cannot come back to epochal ends
its own process, with one line saying why, instead of hanging.

Two cases, each run on a daemon thread of its own while the training code is away:

- :func:`exit_unless_taken`: the run was aborted (or the client failed); the training code gets
  ``abort_grace`` seconds to take the abort at its next call into epochal, else it sits in a
  collective whose peer is gone and the process exits with :data:`ABORT_EXIT_CODE`;
- :func:`exit_if_stuck`: the coordinator was lost (or the world changes); a worker that keeps
  making progress finishes its epoch and then re-attaches, but one whose training code made no
  progress for the run's heartbeat timeout + ``abort_grace`` seconds (+ the re-attach timeout when
  the coordinator was lost: a peer may be bringing the decision it missed from a restarted
  coordinator) is blocked for good.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from epochal.log import WORKER
from epochal.protocol import Liveness

ABORT_EXIT_CODE = 75
"""Exit status of a worker process ended by an abort it could not leave in time."""


def exit_unless_taken(reason: str, taken: threading.Event, grace: float) -> None:
    """End the process unless ``taken`` is set within ``grace`` seconds."""
    if taken.wait(grace):
        return
    WORKER.error(
        f"epochal: run aborted: {reason}\n"
        f"epochal: the training code did not return to epochal within {grace:g} s "
        f"(blocked in a collective?); exiting with status {ABORT_EXIT_CODE}"
    )
    os._exit(ABORT_EXIT_CODE)


def exit_if_stuck(
    reason: str,
    taken: threading.Event,
    grace: float,
    liveness: Callable[[], Liveness],
    progress_at: Callable[[], float],
    who: str,
) -> None:
    """End the process if the training code is blocked for good: ``taken`` was not set within
    ``grace`` seconds and the training code made no progress (``progress_at()``, a
    ``time.monotonic()`` instant) for the heartbeat timeout + ``grace`` seconds since. ``who``
    names the worker in the line it prints."""
    limit = liveness().timeout + grace
    if taken.wait(grace):
        return
    while True:
        stalled = time.monotonic() - progress_at()
        if stalled >= limit:
            break
        if taken.wait(min(limit - stalled, liveness().interval)):
            return
    WORKER.error(
        f"epochal: {who}: {reason}; the training code made no progress for {stalled:.0f} s "
        f"(blocked in a collective whose peer is gone?) and cannot re-attach from there: "
        f"exiting with status {ABORT_EXIT_CODE}"
    )
    os._exit(ABORT_EXIT_CODE)
