"""The one way a test waits for an outcome: :func:`wait_until`, with a deadline, naming what it
waited for when the deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str | Callable[[], str],
    interval: float = 0.05,
) -> None:
    """Return once ``predicate()`` is true; fail with ``what`` (the failure, in words, or a
    callable that says it then: what the state was at the deadline) if it is still false
    ``timeout`` seconds from now. It is asked every ``interval`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{said(what)} (waited {timeout:g} s)"
        time.sleep(interval)


def said(what: str | Callable[[], str]) -> str:
    """``what`` in words: itself, or what it says when called."""
    return what if isinstance(what, str) else what()
