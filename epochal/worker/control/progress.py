"""Progress of training code that runs a loop of its own, told by the CPU it uses.

A session opened for the rendezvous only, or a torchrun script run by ``epochal worker
--torchrun``, reports no steps: its heartbeats would say the same thing for as long as it trains,
and the coordinator's stall report and ``--stall-abort`` would take a long loop for a hung one. So
each heartbeat asks :class:`CpuProgress` whether the code used CPU since the last step it counted:
a loop that trains does, a thread blocked in a collective whose peer is gone does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

BUSY_STEP = 0.01
"""CPU seconds of training code that count as progress between two heartbeats: more than a
thread blocked in a collective uses, less than any step of training."""


def thread_cpu(thread_id: int) -> Callable[[], float]:
    """The CPU seconds thread ``thread_id`` (a :func:`threading.get_ident`) has used so far."""
    clock = time.pthread_getcpuclockid(thread_id)
    return lambda: time.clock_gettime(clock)


def process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has used (its threads included), from ``/proc``."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuProgress:
    """Counts a step each time ``used()`` (CPU seconds) grew by :data:`BUSY_STEP`."""

    def __init__(self, used: Callable[[], float]) -> None:
        self._used = used
        self._seen = 0.0

    def grew(self) -> bool:
        """Whether the CPU used grew by a step since the last time it did; False when the
        process watched has just ended."""
        try:
            used = self._used()
        except OSError:
            return False
        if used - self._seen < BUSY_STEP:
            return False
        self._seen = used
        return True
