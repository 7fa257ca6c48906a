"""How a run's end is said: why it stopped, the Finish every rank gets, the summary and result.

Pure functions of the loop state, for :class:`~epochal.coordinator.rules.machine.RunMachine`.
"""

from __future__ import annotations

from typing import Any

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.actions import RunSummary
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.outcome import EpochOutcome, format_loss
from epochal.protocol import Finish
from epochal.text import counted


def stop_lines(outcome: EpochOutcome, loop: LoopState, config: CoordinatorConfig) -> list[str]:
    """Why the run stops before its last epoch (nothing when it simply ran them all)."""
    if outcome.stop_reason == "lr_factor":
        return [f"the learning-rate factor reached {outcome.next_lr_factor:g}: stopping"]
    if outcome.stop_reason == "patience":
        return [
            f"no improvement for {counted(loop.stale, 'validated epoch')} "
            f"(patience {config.patience}): stopping early"
        ]
    return []


def finish(loop: LoopState, config: CoordinatorConfig, run_id: str) -> tuple[Finish, str]:
    """The Finish every rank gets, and the line that says the run finished."""
    message = Finish(
        best_epoch=loop.best_epoch,
        best_loss=loop.best_loss,
        epochs_run=len(loop.history),
        restore_best=config.restore_best,
    )
    if not loop.history:  # the workers kept a loop of their own (join() for the group only)
        return message, f"run {run_id} finished: its workers ran their own loop, no epochs here"
    line = (
        f"run {run_id} finished after {counted(len(loop.history), 'epoch')}: best epoch "
        f"{loop.best_epoch} (smoothed {loop.monitor} {format_loss(loop.best_loss)})"
    )
    return message, line


def result(loop: LoopState, run_id: str) -> tuple[RunSummary, dict[str, Any]]:
    """The finished run's summary (returned by the service) and its result.json record."""
    summary = RunSummary(
        run_id=run_id,
        best_epoch=loop.best_epoch,
        best_loss=loop.best_loss,
        epochs_run=len(loop.history),
        history=list(loop.history),
    )
    record = {
        "status": "finished",
        "run_id": run_id,
        "best_epoch": loop.best_epoch,
        "best_loss": loop.best_loss,
        "epochs_run": len(loop.history),
    }
    return summary, record
