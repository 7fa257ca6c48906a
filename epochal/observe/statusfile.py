"""``RUN_DIR/status.json``: where a run is, replaced atomically every few seconds, and
``epochal status RUN_DIR``, which prints it at a glance.

The file holds the coordinator's state, the epoch, the best epoch so far, the monitored value's name
(``monitor``: what ``smoothed`` and ``best`` are of), the last epoch's losses, one row per rank
(phase, epoch, step, the line its code is at, seconds since it made progress and since it was last
heard; its epoch is the header's, see :func:`epochal.coordinator.serve.feed.rank_at`) and
``events``: every start of the run, a restart after a failure in the same process or a resume by a
new one, with the epoch it started at. A resuming coordinator carries the earlier events over, so
the file keeps the whole history that ``epochs.jsonl`` does not (it drops the epochs a resume trains
again).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeGuard

from epochal.errors import ConfigError
from epochal.observe.observer import RunObserver, RunStart, StatusSnapshot, World
from epochal.observe.runfiles import (
    epoch_records,
    read_records,
    read_result,
    read_run,
    read_status,
    write_json_atomic,
)
from epochal.rundir.files import private_dir
from epochal.rundir.paths import (
    RESULT_FILE,
    STATUS_FILE,
    monitor_of,
    rate_label,
    smoothed_label,
    standing,
)
from epochal.text import PRINTABLE_CHARS, counted, printable

INTERVAL = 2.0
"""Seconds between two rewrites of status.json for heartbeat snapshots alone (an epoch, a join,
a start and the end are written at once)."""

_LAST_FIELDS = ("epoch", "train_loss", "valid_loss", "smoothed_loss", "lr_factor", "lr", "seconds")
_POSITION_FIELDS = (
    "train_batches",
    "steps",
    "data_pass",
    "data_offset",
    "pass_batches",
    "global_batch",
)
"""What a run with steps per epoch keeps of its last epoch besides: where the data stands."""


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
        self._checked = False
        # the run directory was checked to be this user's alone (once: it does not change hands)
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
        if not self._checked:
            private_dir(self.path.parent, kind="run directory")
            self._checked = True
        write_json_atomic(self.path, self._data)
        self._written = self._clock()

    def on_start(self, start: RunStart) -> None:
        self._ended = False
        events: list[dict[str, Any]] = self._data["events"]
        if not events and start.resumed_from is not None:
            try:
                previous = read_status(self.path.parent) or {}
            except ConfigError:  # not a file a run wrote: nothing to carry over, it is replaced
                previous = {}
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
            monitor=monitor_of(start.config),
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
        self._data["epoch_ends_in"] = snapshot.epoch_ends_in

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        if self._ended:
            return
        self._take(status)
        if record.get("kind") == "checkpoint":
            self._data["last_checkpoint"] = record.get("epoch")
            return
        if record.get("kind") == "world":  # the world changed: the snapshot says its size
            self._write()
            return
        self._data["last"] = {k: record.get(k) for k in _LAST_FIELDS}
        self._data["last"].update({k: record[k] for k in _POSITION_FIELDS if k in record})
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
#
# Everything below reads files another user may have written (a run directory in a shared place,
# or one copied from elsewhere): every value shown goes through printable(), every container is
# checked for its type before use, and a number is shown as a number only when it is one.

REASON_CHARS = 1000
"""Longest abort reason shown (a reason naming many ranks is longer than a field)."""


def _t(value: Any, limit: int = PRINTABLE_CHARS) -> str:
    """A value read from the files, safe to print."""
    return printable(value, limit)


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _loss(value: Any) -> str:
    return f"{value:.4f}" if _is_number(value) else "-"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _alive(pid: Any, host: Any) -> bool | None:
    """Whether the process ``pid`` runs, when it is on this host; None: cannot tell."""
    if type(pid) is not int or pid <= 0 or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):
        return None
    return True


def _epoch_line(record: Mapping[str, Any], monitor: str) -> str:
    factor, rate = record.get("lr_factor"), record.get("lr")
    lr = ""
    if _is_number(rate) or _is_number(factor):  # as the coordinator's epoch line says it
        lr = "  " + rate_label(
            rate if _is_number(rate) else None, factor if _is_number(factor) else 1
        )
    seconds = record.get("seconds")
    return (
        f"last epoch {_t(record.get('epoch'))}: train {_loss(record.get('train_loss'))}  "
        f"valid {_loss(record.get('valid_loss'))}  "
        f"{_t(smoothed_label(monitor))} {_loss(record.get('smoothed_loss'))}"
        + "".join(
            f"  {_t(key.replace('_', ' ', 1))} {_loss(record.get(key))}"
            for key in _list(record.get("metrics"))
            if isinstance(key, str)
        )
        + lr
        + (f"  {seconds:.2f}s" if _is_number(seconds) else "")
    )


def _data_line(record: Mapping[str, Any], ranks: list[Any]) -> list[str]:
    """Runs with steps per epoch: the step the epoch under way is at (the slowest training
    rank's) and where the data stands after the last epoch, with the share of its pass done."""
    steps, batches = record.get("steps"), record.get("train_batches")
    if not _is_number(steps):
        return []
    line = f"epochs of {_t(steps)} steps"
    done = [
        r["step"]
        for r in ranks
        if isinstance(r, dict) and r.get("phase") == "train" and _is_number(r.get("step"))
    ]
    if done and _is_number(batches) and batches > 0:
        line += f", step {int(min(done) * steps // batches)}/{_t(steps)} of this one"
    at, offset = record.get("data_pass"), record.get("data_offset")
    k, size = record.get("pass_batches"), record.get("global_batch")
    if _is_number(at) and _is_number(offset):
        line += f"; data: pass {_t(at)}, {_t(offset)} samples in"
        if _is_number(k) and _is_number(size) and k > 0 and size > 0:
            line += f" ({offset / size / k:.0%} of the pass)"
    return [line]


def _epochs(count: Any) -> str:
    """``1 epoch``, ``3 epochs`` (a count read from the files, so maybe not a number)."""
    return counted(count, "epoch") if type(count) is int else f"{_t(count)} epochs"


def _epoch_of(epoch: Any, epochs: Any) -> str:
    """``epoch 2 [3/10]``, as the coordinator's epoch line counts (epochs numbered from 0)."""
    if type(epoch) is not int:
        return f"epoch {_t(epoch if epoch is not None else '?')}"
    of = f"/{_t(epochs)}" if epochs else ""
    return f"epoch {epoch} [{epoch + 1}{of}]"


def rank_table(ranks: list[dict[str, Any]]) -> str:
    """One line per rank: rank, host, phase, epoch, step, still for, heard, at."""
    header = ("rank", "host", "phase", "epoch", "step", "still for", "heard", "at")
    body = []
    for r in ranks:
        idle, heard = r.get("idle"), r.get("last_heard")
        body.append(
            (
                _t(r.get("rank", "?")),
                _t(r.get("host", "")),
                _t(r.get("phase", "?")),
                _t(r.get("epoch", "")),
                _step(r),
                f"{idle:.1f} s" if _is_number(idle) else "-",
                f"{heard:.1f} s ago" if _is_number(heard) else "-",
                _t(r.get("where", "")),
            )
        )
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=False)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *body)
    )


def _step(rank: Mapping[str, Any]) -> str:
    """A rank's step, of how many its phase of the epoch has when known: ``2246/4000``."""
    step, steps = rank.get("step", ""), rank.get("steps")
    return f"{_t(step)}/{_t(steps)}" if type(steps) is int else _t(step)


def _epoch_end(status: Mapping[str, Any], now: float) -> list[str]:
    """When the epoch under way ends, at the rate so far: one line while it runs, else none."""
    left, taken = status.get("epoch_ends_in"), status.get("snapshot_time")
    if status.get("state") != "running" or not (_is_number(left) and _is_number(taken)):
        return []
    return [
        f"epoch {_t(status.get('epoch'))} ends in about {max(0.0, left - (now - taken)):.0f} s "
        "(at the rate its slowest rank went so far)"
    ]


def describe(run_dir: Path, *, now: float | None = None) -> str:
    """The run in ``run_dir`` at a glance: live from status.json; once it ended (or without
    status.json), from result.json and the journal. Raises
    :class:`~epochal.observe.runfiles.UnreadableRunFile` naming a file that is not a run's."""
    now = time.time() if now is None else now
    status = read_status(run_dir)
    result = current_result(run_dir, status)
    run = read_run(run_dir) or {}
    journal = read_records(run_dir)
    records = epoch_records(journal)
    live = status or {}
    run_id = (result or {}).get("run_id") or live.get("run_id") or run.get("run_id")
    epochs = live.get("epochs") or _obj(run.get("config")).get("epochs")
    monitor = monitor_of(live if "monitor" in live else _obj(run.get("config")))
    smoothed = f"smoothed {_t(monitor)}"
    lines = []
    head = f"run {_t(run_id or '?')}{_attempt(run, result)} in {_t(run_dir)}: "
    if result is not None and result.get("status") == "finished":
        lines.append(
            head + f"finished after {_epochs(result.get('epochs_run'))}, best epoch "
            f"{_t(result.get('best_epoch'))} ({smoothed} {_loss(result.get('best_loss'))})"
        )
    elif result is not None and result.get("status") == "aborted":
        lines.append(head + f"aborted: {_t(result.get('reason', '?'), REASON_CHARS)}")
    elif status is not None:
        lines.append(
            head + f"{_t(status.get('state', '?'))}, {_epoch_of(status.get('epoch'), epochs)}, "
            f"{_t(status.get('joined', '?'))}/{_t(status.get('world_size', '?'))} workers joined"
        )
        alive = _alive(status.get("pid"), status.get("host"))
        updated = status.get("updated")
        seen = f"updated {_ago(now - updated)}" if _is_number(updated) else "updated"
        if alive is False:
            lines.append(
                f"{seen} by pid {_t(status.get('pid'))}, which is no longer running: the "
                "coordinator stopped without a result (killed?); the same command again resumes "
                "the run"
            )
        else:
            lines.append(f"{seen} by pid {_t(status.get('pid'))} on {_t(status.get('host'))}")
            lines += _epoch_end(status, now)
    elif records:
        lines.append(
            head + f"{counted(len(records), 'epoch')} journaled, no result and no status.json (a "
            "coordinator without status reporting, or one that was stopped)"
        )
    else:
        lines.append(head + "nothing recorded yet")
    if records:
        best = records[-1].get("best_epoch")
        at = next((r for r in records if r["epoch"] == best), None)
        if result is None and best is not None:
            lines.append(
                f"best so far: epoch {_t(best)} ({smoothed} "
                f"{_loss(None if at is None else at.get('best_loss'))})"
            )
        lines.append(_epoch_line(records[-1], monitor))
    elif isinstance(live.get("last"), dict):
        lines.append(_epoch_line(live["last"], monitor))
    last = records[-1] if records else _obj(live.get("last"))
    lines += _data_line(last, _list(live.get("ranks")) if result is None else [])
    lines += world_lines(journal)
    if status is not None:
        events = [e for e in _list(status.get("events")) if isinstance(e, dict)]
        again = [e for e in events if e.get("kind") in ("restart", "resume")]
        if again:
            said = ", ".join(f"{e['kind']} at epoch {_t(e.get('start_epoch'))}" for e in again)
            lines.append(f"restarts: {_t(status.get('restarts', 0))} ({said})")
        ranks = _list(status.get("ranks"))
        if result is None and ranks:
            lines.append(rank_table([r for r in ranks if isinstance(r, dict)]))
    return "\n".join(lines)


def _attempt(run: Mapping[str, Any], result: Mapping[str, Any] | None) -> str:
    """``, attempt 2,``: which attempt of the run run.json (the newest's), else result.json
    names; nothing for a run written before attempts were numbered."""
    number = run.get("attempt", (result or {}).get("attempt"))
    return f", attempt {_t(number)}," if type(number) is int else ""


_RESTORED = {
    "memory": "restored from memory",
    "checkpoint": "restored from the checkpoint of epoch {checkpoint}",
    "peers": "state sent from rank 0",
}
"""How a change's ``restore`` (:class:`~epochal.protocol.Restore`) reads in a world line."""


def world_lines(journal: list[dict[str, Any]]) -> list[str]:
    """One line per change of an elastic run's world, from the journal's ``world`` records that
    stand: ``world changed before epoch 1: 4 -> 3 workers (generation 1; lost rank 3 (...);
    restored from memory; 0.8 s)``. No line for a run whose world never changed."""
    lines = []
    for record in standing(journal):
        if record.get("kind") != "world":
            continue
        said = [f"generation {_t(record.get('generation'))}"]
        lost = [_t(x) for x in _list(record.get("lost"))]
        joined = [_t(x) for x in _list(record.get("joined"))]
        if lost:
            said.append(f"lost {', '.join(lost)}")
        if joined:
            said.append(f"joined {', '.join(joined)}")
        source = _RESTORED.get(str(record.get("restore")))
        if source is not None:
            said.append(source.format(checkpoint=_t(record.get("checkpoint"))))
        if _is_number(record.get("seconds")):
            said.append(f"{record['seconds']:.1f} s")
        lines.append(
            f"world changed before epoch {_t(record.get('epoch'))}: {_t(record.get('from'))} -> "
            f"{_t(record.get('to'))} workers ({'; '.join(said)})"
        )
    return lines


def current_result(run_dir: Path, status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """result.json, unless status.json shows the run going on after it was written (an aborted
    attempt's result stays until the restarted run ends)."""
    result = read_result(run_dir)
    if result is None or status is None or status.get("state") in ("finished", "aborted"):
        return result
    updated = status.get("updated")
    try:
        written = os.lstat(run_dir / RESULT_FILE).st_mtime
    except OSError:
        return result
    if _is_number(updated) and updated > written:
        return None
    return result


def ended(run_dir: Path) -> bool:
    """Whether the run has ended (finished, or aborted and not going on)."""
    return current_result(run_dir, read_status(run_dir)) is not None
