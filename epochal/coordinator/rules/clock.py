"""Time the coordinator itself was not running, so no rank is blamed for it.

The service reads its clock every loop turn (at most ``step`` seconds apart when it runs). A much
longer gap between two readings means the coordinator's own process was stopped (SIGSTOP, a
suspended machine, a swap storm, a blocking call): for that long it could not read anything, so
the silence of every rank in that window says nothing about the ranks. The service moves every
deadline it keeps forward by the lost time: each rank gets a fresh heartbeat window.
"""

from __future__ import annotations

GAP_SLACK = 1.0
"""Seconds of lateness beyond ``step`` still counted as running (scheduling noise, a slow frame)."""


def lost_time(previous: float, now: float, step: float) -> float:
    """Seconds between two clock readings during which the service was not running; 0 if none.

    A turn that took at most ``step + GAP_SLACK`` seconds lost nothing; a longer one lost all
    beyond ``step``.
    """
    elapsed = now - previous
    if elapsed <= step + GAP_SLACK:
        return 0.0
    return elapsed - step
