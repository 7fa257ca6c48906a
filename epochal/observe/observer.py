"""What observers of a run are told, and the fan-out that keeps their failures out of the run.

The coordinator calls a :class:`RunObserver`'s methods as the run goes: ``on_start`` when a
coordinator (the first, or one started again after a failure) has bound, ``on_join`` as workers
join and once the ranks are assigned, ``on_epoch`` with every record it journals, ``on_status``
every heartbeat interval, ``on_end`` with what it writes to ``result.json``. The owner of the
observers (the command line, the launcher) calls ``close`` once the run's last attempt is over,
outside the coordinator's event loop: slow work (drawing the learning curve) belongs there.
:class:`Observers` calls several and drops one that raises, with one warning line: watching a
run must never stop it. Nothing here imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epochal.log import COORDINATOR


@dataclass(frozen=True, slots=True)
class RunStart:
    """A coordinator has bound and is about to serve the run."""

    run_id: str
    run_dir: Path | None
    endpoint: str
    world_size: int
    epochs: int
    attempt: int = 0
    # 0 for the first coordinator of this process, N for the N-th restart after a failure
    resumed_from: int | None = None
    # the epoch whose checkpoint the workers load; None: the run starts at epoch 0
    config: Mapping[str, Any] = field(default_factory=dict)
    # the configuration as run.json records it

    @property
    def start_epoch(self) -> int:
        return 0 if self.resumed_from is None else self.resumed_from + 1


@dataclass(frozen=True, slots=True)
class World:
    """Who has joined: ``hosts`` by rank once ranks are assigned (empty before)."""

    joined: int
    world_size: int
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RankStatus:
    """Where one rank is, as its last heartbeat said (the coordinator's stall table, one row)."""

    rank: int
    host: str
    phase: str
    epoch: int
    step: int
    idle: float
    # seconds since its (phase, epoch, step) or its line last changed
    where: str
    # the line its training code was executing, "file.py:12 in fn"
    last_heard: float
    # seconds since anything arrived from it
    steps: int | None = None
    # how many steps its phase of the epoch has (its train or validation batches); None: unknown

    @classmethod
    def from_row(
        cls, row: tuple[int, str, str, int, int, float, str], last_heard: float
    ) -> RankStatus:
        """From a row of the coordinator's stall table: (rank, host, phase, epoch, step, idle,
        where), plus the seconds since the rank was last heard."""
        rank, host, phase, epoch, step, idle, where = row
        return cls(rank, host, phase, epoch, step, idle, where, last_heard)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "phase": self.phase,
            "epoch": self.epoch,
            "step": self.step,
            "idle": round(self.idle, 3),
            "where": self.where,
            "last_heard": round(self.last_heard, 3),
            **({} if self.steps is None else {"steps": self.steps}),
        }


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    """The coordinator's view of the run at one moment."""

    run_id: str
    state: str
    # the coordinator's phase: rendezvous, store, ready, running, finishing, ended
    epoch: int
    # the epoch being run (or next to run)
    epochs: int
    world_size: int
    joined: int
    best_epoch: int | None = None
    best_loss: float | None = None
    ranks: Sequence[RankStatus] = ()
    refused: int = 0
    # hellos refused so far by this coordinator (wrong job or token, surplus, duplicate)
    round_seconds: float | None = None
    # the last epoch's control round: from the first rank's loss report to the decision sent
    epoch_ends_in: float | None = None
    # seconds until the epoch under way ends, at the rate its slowest rank went so far
    time: float = field(default_factory=time.time)


class RunObserver:
    """Base class: every method does nothing; override those you need."""

    def on_start(self, start: RunStart) -> None:
        pass

    def on_join(self, world: World) -> None:
        pass

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        """``record`` is a journal record as written to epochs.jsonl: ``kind`` "epoch" (losses,
        best epoch, learning-rate factor, ...) or "checkpoint" (a committed checkpoint)."""

    def on_status(self, snapshot: StatusSnapshot) -> None:
        pass

    def on_end(self, result: Mapping[str, Any]) -> None:
        """``result`` is result.json's content: ``status`` "finished" or "aborted"."""

    def close(self) -> None:
        """The run is over (its last attempt too): finish, release files, ports and threads."""


class Observers(RunObserver):
    """Calls every observer in turn. One that raises is named in one warning line and dropped,
    so the run goes on as if it had never been there."""

    def __init__(self, observers: Iterable[RunObserver] = ()) -> None:
        self._observers = list(observers)

    def __len__(self) -> int:
        return len(self._observers)

    def __bool__(self) -> bool:
        return bool(self._observers)

    def add(self, observer: RunObserver) -> None:
        self._observers.append(observer)

    def _each(self, method: str, *args: Any) -> None:
        for observer in list(self._observers):
            try:
                getattr(observer, method)(*args)
            except Exception as exc:  # any failure of an observer: never the run's
                self._drop(observer, method, exc)

    def _drop(self, observer: RunObserver, method: str, exc: Exception) -> None:
        if observer in self._observers:
            self._observers.remove(observer)
        COORDINATOR.warning(
            f"warning: {type(observer).__name__} failed in {method} and is switched off for "
            f"this run: {type(exc).__name__}: {exc}"
        )
        if method != "close":
            try:
                observer.close()
            except Exception:
                pass  # already reported once

    def on_start(self, start: RunStart) -> None:
        self._each("on_start", start)

    def on_join(self, world: World) -> None:
        self._each("on_join", world)

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        self._each("on_epoch", record, status)

    def on_status(self, snapshot: StatusSnapshot) -> None:
        self._each("on_status", snapshot)

    def on_end(self, result: Mapping[str, Any]) -> None:
        self._each("on_end", result)

    def close(self) -> None:
        self._each("close")
        self._observers.clear()
