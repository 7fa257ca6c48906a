"""Deterministic fault injection for tests (ours and users'): fail at a named point of a run.

Set ``EPOCHAL_FAULT`` in a worker's environment to ``ACTION@POINT[:key=value...]``, e.g.
``kill@checkpoint-commit:rank=0:epoch=1`` or ``raise@train-step:rank=1:epoch=2:step=5``.

Actions: ``kill`` (SIGKILL this process: a crash with no cleanup), ``raise`` (an exception in the
training code), ``exit`` (``os._exit(3)``), ``stop`` (SIGSTOP: the whole process freezes, its
heartbeats too), ``hang`` (the training code blocks for an hour while heartbeats go on: a stall),
``delay`` (the training code sleeps ``ms`` milliseconds, e.g. ``delay@train-step:rank=1:ms=200``).
Points: ``train-step`` (before a training step),
``checkpoint-commit`` (rank 0, after every rank wrote the checkpoint, before it is renamed into
place), ``epoch-end`` (after the epoch's report). Without the variable every check is a dict
lookup that finds nothing.
"""

from __future__ import annotations

import functools
import os
import signal
import time

FAULT_ENV = "EPOCHAL_FAULT"
ACTIONS = ("kill", "raise", "exit", "stop", "hang", "delay")
_PARAMETERS = ("ms",)  # settings of the action, not conditions on where it fires
POINTS = ("train-step", "checkpoint-commit", "epoch-end")


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` fault."""


@functools.cache
def _plan() -> tuple[str, str, dict[str, int], dict[str, int]] | None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return None
    head, *conditions = spec.split(":")
    action, _, point = head.partition("@")
    if action not in ACTIONS or point not in POINTS:
        raise ValueError(
            f"{FAULT_ENV}={spec!r}: expected ACTION@POINT with ACTION one of {ACTIONS} and POINT "
            f"one of {POINTS}"
        )
    where: dict[str, int] = {}
    settings: dict[str, int] = {}
    for condition in conditions:
        key, _, value = condition.partition("=")
        (settings if key in _PARAMETERS else where)[key] = int(value)
    return action, point, where, settings


def hit(point: str, **at: int) -> None:
    """Fire the configured fault if it names ``point`` and every condition matches ``at``."""
    plan = _plan()
    if plan is None:
        return
    action, wanted, where, settings = plan
    if wanted != point or any(at.get(k) != v for k, v in where.items()):
        return
    match action:
        case "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        case "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        case "exit":
            os._exit(3)
        case "hang":
            time.sleep(3600)
        case "delay":
            time.sleep(settings.get("ms", 100) / 1000)
        case _:
            raise InjectedFault(f"injected fault at {point} {at}")
