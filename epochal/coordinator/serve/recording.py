"""What the coordinator service writes and tells: the run directory's journal and ``run.json``
(:meth:`Recording._start_journal`, :meth:`Recording._write`) and the observers (status.json,
TensorBoard, Prometheus, the plot) after each turn of actions.

:class:`Recording` is the part of :class:`~epochal.coordinator.serve.service.Coordinator` that does
it;
the service sets every attribute below. A record that cannot be written raises
:class:`~epochal.coordinator.serve.journal.JournalError`, and the service stops the run with what
:meth:`Recording._unwritten` says.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules import steering
from epochal.coordinator.rules.actions import Journal, RunPhase, RunSummary
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.runstate import RunState
from epochal.coordinator.serve import oslimits, resume
from epochal.coordinator.serve.attempts import RunAttempt
from epochal.coordinator.serve.feed import ObserverFeed, snapshot
from epochal.coordinator.serve.journal import Journal as RunJournal
from epochal.coordinator.serve.journal import JournalError
from epochal.errors import RunAborted
from epochal.observe import StatusSnapshot
from epochal.rundir.files import remove
from epochal.rundir.paths import RESULT_FILE


class Recording:
    """The journal and the observers; see the module docstring."""

    config: CoordinatorConfig
    run_id: str
    attempt: RunAttempt
    endpoint: str | None
    _journal: RunJournal | None
    _state: RunState | None
    _machine: RunMachine | None
    _feed: ObserverFeed
    _outcome: RunSummary | RunAborted | None

    _log: Callable[[str], None]

    @property
    def machine(self) -> RunMachine:
        raise NotImplementedError  # the service's

    @property
    def phase(self) -> RunPhase:
        raise NotImplementedError  # the service's

    def _start_journal(self, run_dir: Path, state: RunState) -> None:
        """Open the journal (keeping the records up to the resumed checkpoint), write run.json
        and say where the run resumes. A run given more epochs has no result any more: a kill
        before its new end must not leave it looking finished at its old one."""
        if state.extended_from is not None:
            remove(run_dir / RESULT_FILE)
        self._journal = RunJournal(run_dir)
        # kept whole (what still stands of it) while running workers may be taken back; cut back
        # to the resumed checkpoint once the first hello says they were started again instead
        self._journal.rewrite(state.records if state.carry is None else state.carry.records)
        info: dict[str, Any] = {
            "run_id": self.run_id,
            "attempt": self.attempt.number,
            "attempt_id": self.attempt.attempt_id,  # what this attempt's workers know (.attempts)
            "endpoint": self.endpoint,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "resumed_from": state.resume_epoch,
            "config": resume.config_record(self.config),
        }
        if state.extensions:
            info["extended"] = state.extensions
        if state.steered:
            info["steered"] = state.steered
        self._journal.start(info)
        for change in state.steered_now:
            self._log(steering.steered_line(change))
        if state.extended_from is not None:
            self._log(
                f"training the run in {run_dir} further: {state.extended_from} epochs before, "
                f"{self.config.epochs} now"
            )
        if state.carry is not None:
            where = "its finish" if state.carry.stopped else f"epoch {state.carry.epoch}"
            self._log(
                f"the journal in {run_dir} left the run in {where}: its workers, if they still "
                "run, are taken back there; workers started again resume from "
                + (
                    "epoch 0"
                    if state.resume_epoch is None
                    else f"the checkpoint of epoch {state.resume_epoch}"
                )
            )
        else:
            self._say_resuming(run_dir, state)

    def _say_resuming(self, run_dir: Path, state: RunState) -> None:
        """Where the run resumes, when it resumes from a checkpoint."""
        if state.resume_epoch is not None:
            now, had = self.config.world_size, resume.last_world_size(state.records)
            resized = (
                ""
                if had in (None, now)
                else f", at {now} workers where it had {had} (the state resharded, the loaders "
                f"made for {now})"
            )
            self._log(
                f"resuming {run_dir} at epoch {state.start_epoch} from the checkpoint of epoch "
                f"{state.resume_epoch} (best so far: epoch {state.loop.best_epoch}){resized}"
            )

    def _unwritten(self, exc: JournalError) -> str:
        """What a failed write says; out of file descriptors, also how to raise the limit."""
        if oslimits.is_too_many_files(exc):
            return f"{exc}: {oslimits.too_many_files_message(self.config.world_size)}"
        return str(exc)

    def _tell_observers(self) -> None:
        self._feed.tell(self._machine, self._outcome is None, self._snapshot)

    def _snapshot(self) -> StatusSnapshot:
        """The run as the observers see it (status.json, metrics)."""
        assert self._state is not None
        return snapshot(self.machine, self._state.loop, self.run_id, self.phase, time.monotonic())

    def _write(self, action: Journal) -> None:
        """Write the record, then tell the observers: an epoch's once every action of this turn
        is carried out (the decision is not held up for them), the result at once."""
        record = {**action.record, "attempt": self.attempt.number}  # the attempt that wrote it
        if action.kind == "epoch":
            record["time"] = time.time()
        if action.kind == "result" and self._state is not None and self._state.extensions:
            record = {**record, "extended": self._state.extensions}  # as run.json says
        if action.kind == "result" and self._state is not None and self._state.steered:
            record = {**record, "steered": self._state.steered}  # as run.json says
        if action.kind == "rewrite":  # the journal's records up to the resumed checkpoint
            if self._journal is not None:
                self._journal.rewrite(action.record["records"])
            if self._state is not None and self.config.run_dir is not None:
                self._say_resuming(self.config.run_dir, self._state)
            return
        try:
            if self._journal is not None:
                if action.kind == "epoch":
                    self._journal.epoch(record)
                else:
                    self._journal.result(record)
        except JournalError as exc:
            if not action.tolerant:
                raise
            self._log(f"the abort is not recorded in the run directory: {self._unwritten(exc)}")
        if action.kind == "epoch":
            if record["kind"] != "go":  # a go is kept for a restarted coordinator only
                self._feed.written(record)
        else:
            self._feed.end(record, self._machine, self._snapshot)
