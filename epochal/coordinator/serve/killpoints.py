"""Deterministic fault injection for tests: the coordinator dies at a named instant of a run.

Set ``EPOCHAL_COORDINATOR_FAULT`` in the coordinator's environment to ``kill@decision:epoch=E``
(optionally ``:ms=M``): the decision of epoch ``E`` goes to the first rank only, and ``M``
milliseconds later (1000 by default: time for the frame to leave) the coordinator process
SIGKILLs itself. That is the one instant a restarted coordinator cannot learn from its workers
alone: one rank has the decision (and goes on into the next epoch), the others wait for it. The
worker side has its own faults (:mod:`epochal.worker.faults`). Without the variable every check
is a lookup that finds nothing.
"""

from __future__ import annotations

import functools
import os
import signal
import time

from epochal.protocol import Decision, Message

FAULT_ENV = "EPOCHAL_COORDINATOR_FAULT"


@functools.cache
def _plan() -> tuple[int, int] | None:
    """(epoch, ms) of the fault the environment asks for; None without one."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    head, *conditions = spec.split(":")
    values = dict(condition.partition("=")[::2] for condition in conditions)
    try:
        if head != "kill@decision" or "epoch" not in values or set(values) - {"epoch", "ms"}:
            raise ValueError
        return int(values["epoch"]), int(values.get("ms", "1000"))
    except ValueError:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected kill@decision:epoch=E[:ms=M]") from None


def cut(message: Message) -> int | None:
    """Milliseconds to live after sending ``message`` to the first rank alone, when it is the
    decision the fault names; None otherwise (send it to every rank)."""
    plan = _plan()
    if plan is None or not isinstance(message, Decision) or message.epoch != plan[0]:
        return None
    return plan[1]


def die(ms: int) -> None:
    """Sleep ``ms`` milliseconds, then SIGKILL this process: a crash with no cleanup."""
    time.sleep(ms / 1000)
    os.kill(os.getpid(), signal.SIGKILL)
