"""The one restart loop: ``epochal run``'s runs, ``epochal worker``'s worker, and the
``epochal coordinator`` service started again after a failure, up to ``--max-restarts`` times.

Each caller says what one attempt is (start the workers, run the coordinator, run the worker
command) and what it says when it restarts or gives up; the counting, and when to stop, are here
once: an attempt whose outcome is final (a finish, a signal, a failure a restart cannot mend) ends
the loop with its status; a failed one is retried while restarts are left, and the last failure's
status is the one to leave with.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt ended."""

    status: int
    """The exit status to leave with if this is the last attempt."""
    reason: str = ""
    """Why it failed, for the line that says the restarts are used up."""
    retry: bool = False
    """A failure a restart may mend (the run resumes from its last committed checkpoint)."""
    unfinished: bool = False
    """The run stopped before it finished (aborted, interrupted): its run directory resumes it."""
    needs_fix: bool = False
    """The run stopped on a configuration or data error (:attr:`RunAborted.needs_fix`): neither a
    restart nor a resume mends it; the user fixes it and runs the same command again."""


async def restarting(
    attempt: Callable[[int], Awaitable[Outcome]],
    max_restarts: int,
    *,
    restart: Callable[[int, Outcome], Awaitable[None]],
    give_up: Callable[[Outcome], None],
) -> int:
    """Await ``attempt(0)``; while its outcome asks for a retry and restarts are left, await
    ``restart(n, outcome)`` (say so, wait, prepare) and ``attempt(n)`` for n = 1, 2, ...

    Returns the status of the last attempt. ``give_up(outcome)`` is called when the restarts
    (at least one) are used up and the last attempt failed too.
    """
    outcome = await attempt(0)
    for n in range(1, max_restarts + 1):
        if not outcome.retry:
            return outcome.status
        await restart(n, outcome)
        outcome = await attempt(n)
    if outcome.retry and max_restarts:
        give_up(outcome)
    return outcome.status
