"""One id per run, a number per attempt: which run a coordinator serves, and which attempt of it.

A run's id is its first attempt's. Every later coordinator on the same run directory (a resume,
a restart after a failure, a finished run trained further) reads it back from run.json and keeps
it, so that the first line, result.json, status.json and ``epochal status`` name the run the same
way throughout. Each coordinator started on the directory is one more attempt, numbered from 1:
run.json, result.json, the journal's records and ``epochal status`` carry its number.

What a run's workers know it by is another id, the attempt's own (:attr:`RunAttempt.attempt_id`,
the ``run_id`` of the wire's hello and welcome): it tells the workers of one attempt from those
of another. A worker still running from an earlier attempt is taken back only by the id it knows
(:mod:`.takeback`), and the workers scope their store's keys under it, so that no key an earlier
attempt left is read as this one's. The first attempt's is the run's id; a later one makes a new
one, unless it takes running workers back: then it keeps theirs (:class:`~.carry.Carry`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from epochal.coordinator.rules.runstate import RunState


def new_run_id() -> str:
    """A fresh, short, unique run id."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True, slots=True)
class RunAttempt:
    """Which run a coordinator serves, and which attempt of it."""

    run_id: str
    # the run's id: its first attempt's, kept by every later one
    number: int
    # 1 for the first attempt, one more for each coordinator started on the run directory since
    attempt_id: str
    # what this attempt's workers know the run by (see the module docstring)

    @classmethod
    def first(cls, run_id: str) -> RunAttempt:
        return cls(run_id, 1, run_id)

    @property
    def named(self) -> str:
        """How a line names the run: ``run 25b8e266f518, attempt 2``."""
        return f"run {self.run_id}, attempt {self.number}"


def attempt_of(state: RunState, run_id: str) -> RunAttempt:
    """The attempt a coordinator makes of the run its run directory held (``state``), or of a
    new run named ``run_id`` when it held none."""
    earlier = state.run_file
    stored = None if earlier is None else earlier.get("run_id")
    if not _is_id(stored):
        return RunAttempt.first(run_id)
    assert isinstance(stored, str)
    number = _number(earlier) + 1
    if state.carry is not None:  # its workers may come back: they know the run by theirs
        return RunAttempt(stored, number, state.carry.attempt_id)
    return RunAttempt(stored, number, new_run_id())


def workers_id(run: dict[str, Any]) -> str | None:
    """The id the workers of the attempt that wrote ``run`` (run.json) know the run by: its
    ``attempt_id``, or, written before attempts had one, its ``run_id``."""
    known = run.get("attempt_id", run.get("run_id"))
    return known if _is_id(known) else None


def _number(run: dict[str, Any] | None) -> int:
    """The attempt that wrote ``run`` (run.json): 1 when it was written before attempts were
    numbered."""
    number = None if run is None else run.get("attempt")
    return number if type(number) is int and number >= 1 else 1


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and bool(value)
