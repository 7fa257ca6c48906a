"""What the run's decision logic asks the service to do, and the run's phases.

:class:`~epochal.coordinator.rules.machine.RunMachine` takes the clock and a message and returns a
list
of these; :class:`~epochal.coordinator.serve.service.Coordinator` applies them in order (sockets,
files, the log). Applying a :class:`Journal` record may fail: the service then applies nothing
after it, so a decision is never sent before the record of it is durable.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from epochal.coordinator.rules.outcome import EpochOutcome
from epochal.protocol import CoordinatorMessage


class RunPhase(enum.StrEnum):
    """Where the run is, as the coordinator sees it.

    rendezvous -> store (rank 0 opens the data-plane store) -> ready (every rank announces its
    batches, answered by Go) -> running (every rank reports losses, answered by Decision) -> back
    to ready, or finishing (Finish sent, waiting for every Done) -> ended.
    """

    RENDEZVOUS = "rendezvous"
    STORE = "store"
    READY = "ready"
    RUNNING = "running"
    FINISHING = "finishing"
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class RunSummary:
    """How a finished run went, as the coordinator saw it."""

    run_id: str
    best_epoch: int | None
    best_loss: float | None
    epochs_run: int
    history: list[EpochOutcome] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to one peer."""

    peer: bytes
    message: CoordinatorMessage


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Send ``message`` (encoded once) to each of ``peers``."""

    peers: tuple[bytes, ...]
    message: CoordinatorMessage


@dataclass(frozen=True, slots=True)
class Journal:
    """Write a record to the run directory (fsynced before anything after it is applied).

    ``kind`` "epoch" appends to epochs.jsonl and gets the wall-clock ``time`` stamped last;
    "result" writes result.json; "rewrite" replaces epochs.jsonl by ``record["records"]`` (a
    restarted coordinator's resume from a checkpoint, once it knows its workers were started
    again). ``tolerant``: a failure is logged, not an abort (the record of
    an abort itself).
    """

    kind: str
    record: dict[str, Any]
    tolerant: bool = False


@dataclass(frozen=True, slots=True)
class Log:
    """Log a line for a person (through ``epochal.coordinator``)."""

    line: str


@dataclass(frozen=True, slots=True)
class Prune:
    """Delete the checkpoints of these epochs (no longer kept)."""

    epochs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    """The run ended: serve no more and return ``summary``."""

    summary: RunSummary


@dataclass(frozen=True, slots=True)
class Aborted:
    """The run was aborted: serve no more and raise RunAborted(``reason``)."""

    reason: str
    needs_fix: bool = False
    # a configuration or data error, which a resume would repeat (RunAborted.needs_fix)


Action = Send | Broadcast | Journal | Log | Prune | Finished | Aborted
