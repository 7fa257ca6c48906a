"""``RUN_DIR/status.json``: where a run is, replaced atomically every few seconds, and
``epochal status RUN_DIR``, which prints it at a glance.

The file holds the coordinator's state, the epoch, the best epoch so far, the last epoch's losses,
one row per rank (phase, step, the line its code is at, seconds since it made progress and since it
was last heard) and ``events``: every start of the run, a restart after a failure in the same
process or a resume by a new one, with the epoch it started at. A resuming coordinator carries the
earlier events over, so the file keeps the whole history that ``epochs.jsonl`` does not (it drops
the epochs a resume trains again).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from epochal.coordinator.journal import RESULT_FILE
from epochal.observe.base import RunObserver, RunStart, StatusSnapshot, World
from epochal.observe.runfiles import (
    STATUS_FILE,
    epoch_records,
    read_records,
    read_result,
    read_run,
    read_status,
    write_json_atomic,
)

INTERVAL = 2.0
"""Seconds between two rewrites of status.json for heartbeat snapshots alone (an epoch, a join,
a start and the end are written at once)."""

_LAST_FIELDS = ("epoch", "train_loss", "valid_loss", "smoothed_loss", "lr_factor", "seconds")


class StatusFile(RunObserver):
    """Keeps RUN_DIR/status.json up to date."""

    def __init__(
        self,
        run_dir: Path,
        *,
        interval: float = INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(run_dir) / STATUS_FILE
        self._interval = interval
        self._clock = clock
        self._written = -float("inf")
        self._ended = False
        # after on_end, a late snapshot (the coordinator still in its last phase) must not turn
        # the final state back into a running one
        self._data: dict[str, Any] = {
            "state": "starting",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "events": [],
            "restarts": 0,
            "ranks": [],
        }

    def _write(self) -> None:
        self._data["updated"] = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self._data)
        self._written = self._clock()

    def on_start(self, start: RunStart) -> None:
        self._ended = False
        events: list[dict[str, Any]] = self._data["events"]
        if not events and start.resumed_from is not None:
            previous = read_status(self.path.parent) or {}
            carried = previous.get("events")
            if isinstance(carried, list):
                events.extend(e for e in carried if isinstance(e, dict))
        if start.attempt > 0:
            kind = "restart"
        elif start.resumed_from is not None:
            kind = "resume"
        else:
            kind = "start"
            events.clear()  # a run that starts at epoch 0 starts a new history
        events.append(
            {
                "kind": kind,
                "start_epoch": start.start_epoch,
                "resumed_from": start.resumed_from,
                "run_id": start.run_id,
                "time": time.time(),
            }
        )
        self._data.update(
            state="rendezvous",
            run_id=start.run_id,
            endpoint=start.endpoint,
            world_size=start.world_size,
            epochs=start.epochs,
            epoch=start.start_epoch,
            joined=0,
            ranks=[],
            restarts=sum(1 for e in events if e["kind"] == "restart"),
        )
        self._data.pop("result", None)
        self._write()

    def on_join(self, world: World) -> None:
        self._data.update(joined=world.joined, world_size=world.world_size)
        if world.hosts:
            self._data["hosts"] = list(world.hosts)
        # every worker's join would be a file written and renamed: thousands in a rendezvous of
        # thousands; the file follows at most every interval, and at once when all are in
        if world.joined >= world.world_size or self._clock() - self._written >= self._interval:
            self._write()

    def _take(self, snapshot: StatusSnapshot) -> None:
        if self._ended:
            return
        self._data.update(
            run_id=snapshot.run_id,
            state=snapshot.state,
            epoch=snapshot.epoch,
            epochs=snapshot.epochs,
            world_size=snapshot.world_size,
            joined=snapshot.joined,
            best_epoch=snapshot.best_epoch,
            best_loss=snapshot.best_loss,
            refused=snapshot.refused,
            ranks=[r.as_dict() for r in snapshot.ranks],
            snapshot_time=snapshot.time,
        )
        if snapshot.round_seconds is not None:
            self._data["round_seconds"] = snapshot.round_seconds

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        if self._ended:
            return
        self._take(status)
        if record.get("kind") == "checkpoint":
            self._data["last_checkpoint"] = record.get("epoch")
            return
        self._data["last"] = {k: record.get(k) for k in _LAST_FIELDS}
        self._data["best_epoch"] = record.get("best_epoch")
        self._data["best_loss"] = record.get("best_loss")
        self._write()

    def on_status(self, snapshot: StatusSnapshot) -> None:
        if self._ended:
            return
        self._take(snapshot)
        if self._clock() - self._written >= self._interval:
            self._write()

    def on_end(self, result: Mapping[str, Any]) -> None:
        self._data["state"] = str(result.get("status", "ended"))
        self._data["result"] = dict(result)
        self._write()
        self._ended = True


# ---------------------------------------------------------------------- reading it back


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _alive(pid: Any, host: Any) -> bool | None:
    """Whether the process ``pid`` runs, when it is on this host; None: cannot tell."""
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _epoch_line(record: Mapping[str, Any]) -> str:
    lr = record.get("lr_factor")
    seconds = record.get("seconds")
    return (
        f"last epoch {record.get('epoch')}: train {_loss(record.get('train_loss'))}  "
        f"valid {_loss(record.get('valid_loss'))}  smoothed {_loss(record.get('smoothed_loss'))}"
        + "".join(
            f"  {key.replace('_', ' ', 1)} {_loss(record.get(key))}"
            for key in record.get("metrics") or ()
            if isinstance(key, str)
        )
        + (f"  lr x{lr:g}" if isinstance(lr, int | float) else "")
        + (f"  {seconds:.2f}s" if isinstance(seconds, int | float) else "")
    )


def rank_table(ranks: list[dict[str, Any]]) -> str:
    """One line per rank: rank, host, phase, epoch, step, still for, heard, at."""
    header = ("rank", "host", "phase", "epoch", "step", "still for", "heard", "at")
    body = []
    for r in ranks:
        idle, heard = r.get("idle"), r.get("last_heard")
        body.append(
            (
                str(r.get("rank", "?")),
                str(r.get("host", "")),
                str(r.get("phase", "?")),
                str(r.get("epoch", "")),
                str(r.get("step", "")),
                f"{idle:.1f} s" if isinstance(idle, int | float) else "-",
                f"{heard:.1f} s ago" if isinstance(heard, int | float) else "-",
                str(r.get("where", "")),
            )
        )
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=False)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *body)
    )


def describe(run_dir: Path, *, now: float | None = None) -> str:
    """The run in ``run_dir`` at a glance: live from status.json; once it ended (or without
    status.json), from result.json and the journal."""
    now = time.time() if now is None else now
    status = read_status(run_dir)
    result = current_result(run_dir, status)
    run = read_run(run_dir) or {}
    records = epoch_records(read_records(run_dir))
    run_id = (result or {}).get("run_id") or (status or {}).get("run_id") or run.get("run_id")
    epochs = (status or {}).get("epochs") or (run.get("config") or {}).get("epochs")
    lines = []
    head = f"run {run_id or '?'} in {run_dir}: "
    if result is not None and result.get("status") == "finished":
        lines.append(
            head + f"finished after {result.get('epochs_run')} epochs, best epoch "
            f"{result.get('best_epoch')} (smoothed loss {_loss(result.get('best_loss'))})"
        )
    elif result is not None and result.get("status") == "aborted":
        lines.append(head + f"aborted: {result.get('reason', '?')}")
    elif status is not None:
        state = status.get("state", "?")
        of = f" of {epochs}" if epochs else ""
        lines.append(
            head + f"{state}, epoch {status.get('epoch', '?')}{of}, "
            f"{status.get('joined', '?')}/{status.get('world_size', '?')} workers joined"
        )
        alive = _alive(status.get("pid"), status.get("host"))
        updated = status.get("updated")
        seen = f"updated {_ago(now - updated)}" if isinstance(updated, int | float) else "updated"
        if alive is False:
            lines.append(
                f"{seen} by pid {status.get('pid')}, which is no longer running: the coordinator "
                "stopped without a result (killed?); the same command again resumes the run"
            )
        else:
            lines.append(f"{seen} by pid {status.get('pid')} on {status.get('host')}")
    elif records:
        lines.append(
            head + f"{len(records)} epochs journaled, no result and no status.json (a "
            "coordinator without status reporting, or one that was stopped)"
        )
    else:
        lines.append(head + "nothing recorded yet")
    if records:
        best = records[-1].get("best_epoch")
        at = next((r for r in records if r["epoch"] == best), None)
        if result is None and best is not None:
            lines.append(
                f"best so far: epoch {best} (smoothed loss "
                f"{_loss(None if at is None else at.get('best_loss'))})"
            )
        lines.append(_epoch_line(records[-1]))
    elif status is not None and isinstance(status.get("last"), dict):
        lines.append(_epoch_line(status["last"]))
    if status is not None:
        events = [e for e in status.get("events") or [] if isinstance(e, dict)]
        again = [e for e in events if e.get("kind") in ("restart", "resume")]
        if again:
            said = ", ".join(f"{e.get('kind')} at epoch {e.get('start_epoch')}" for e in again)
            lines.append(f"restarts: {status.get('restarts', 0)} ({said})")
        ranks = status.get("ranks")
        if result is None and isinstance(ranks, list) and ranks:
            lines.append(rank_table([r for r in ranks if isinstance(r, dict)]))
    return "\n".join(lines)


def current_result(run_dir: Path, status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """result.json, unless status.json shows the run going on after it was written (an aborted
    attempt's result stays until the restarted run ends)."""
    result = read_result(run_dir)
    if result is None or status is None or status.get("state") in ("finished", "aborted"):
        return result
    updated = status.get("updated")
    try:
        written = (run_dir / RESULT_FILE).stat().st_mtime
    except OSError:
        return result
    if isinstance(updated, int | float) and updated > written:
        return None
    return result


def ended(run_dir: Path) -> bool:
    """Whether the run has ended (finished, or aborted and not going on)."""
    return current_result(run_dir, read_status(run_dir)) is not None
