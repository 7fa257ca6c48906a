"""Reading a run directory as an onlooker: tolerant of a run that is still writing it.

The coordinator appends to ``epochs.jsonl`` while a reader looks, so a half-written last line is
skipped rather than an error; a missing file reads as nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from epochal.coordinator.journal import EPOCHS_FILE, FILE_MODE, RESULT_FILE, RUN_FILE

STATUS_FILE = "status.json"
CURVE_FILE = "curve.png"


def read_json(path: Path) -> dict[str, Any] | None:
    """The object in ``path``; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every readable record of the run's journal, in order (unreadable lines skipped)."""
    try:
        raw = (run_dir / EPOCHS_FILE).read_text(encoding="utf-8")
    except OSError:
        return []
    records = []
    for line in raw.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("epoch"), int):
            records.append(record)
    return records


def epoch_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``epoch`` records, one per epoch (a later one for the same epoch wins)."""
    by_epoch: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == "epoch":
            by_epoch[record["epoch"]] = record
    return [by_epoch[e] for e in sorted(by_epoch)]


def read_run(run_dir: Path) -> dict[str, Any] | None:
    return read_json(run_dir / RUN_FILE)


def read_result(run_dir: Path) -> dict[str, Any] | None:
    return read_json(run_dir / RESULT_FILE)


def read_status(run_dir: Path) -> dict[str, Any] | None:
    return read_json(run_dir / STATUS_FILE)


def is_run_dir(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (RUN_FILE, EPOCHS_FILE, STATUS_FILE))


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` in one step: a reader sees the old file or the new one.

    Mode 0600, as the journal's files: status.json names the endpoint, hosts and pids."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with open(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
