"""What a run directory says about where to start (:class:`RunState`), and which committed
checkpoints may go (:func:`prunable`): the part of resuming that the machine and its decisions
use. No file is read here: :mod:`.resume` reads the run directory and builds the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epochal.coordinator.rules.carry import Carry
from epochal.coordinator.rules.loop import LoopState


@dataclass(slots=True)
class RunState:
    """What the run directory says about where to start."""

    loop: LoopState
    resume_epoch: int | None = None
    # the epoch whose checkpoint the workers load; None: start at epoch 0
    finished: dict[str, Any] | None = None
    # result.json of a run that already finished
    records: list[dict[str, Any]] = field(default_factory=list)
    # the journal records kept (everything up to resume_epoch)
    notes: list[str] = field(default_factory=list)
    # what the user should be told (fallbacks, a dropped half-written line)
    extended_from: int | None = None
    # the epochs the run had, when this resume gives it more (a finished run trained further)
    extensions: list[dict[str, Any]] = field(default_factory=list)
    # every time the run was given more epochs, oldest first: run.json and result.json keep it
    steered: list[dict[str, Any]] = field(default_factory=list)
    # every change of a setting that steers what comes next (steering.steered), oldest first, of
    # the epochs that stand: run.json and result.json keep it
    steered_now: list[dict[str, Any]] = field(default_factory=list)
    # the changes this resume makes, to be said as it starts
    carry: Carry | None = None
    # where running workers are taken back by a restarted coordinator (not for a resume from a
    # checkpoint by workers started again); None: the journal holds no decision to carry on from
    run_file: dict[str, Any] | None = None
    # run.json as the coordinator found it (None: a new run): the run's id and attempt (.attempts)

    @property
    def start_epoch(self) -> int:
        return 0 if self.resume_epoch is None else self.resume_epoch + 1


def prunable(committed: list[int], keep: int, best: int | None) -> list[int]:
    """Committed checkpoints that may go: all but the newest ``keep`` and the best one."""
    newest = set(sorted(set(committed))[-keep:])
    return sorted(e for e in set(committed) if e not in newest and e != best)
