"""What a run leaves in its run directory: ``run.json``, ``epochs.jsonl`` and ``result.json``.

Each epoch's line is written, flushed and fsynced before the coordinator sends the decision it
records, so the file never claims less than the workers were told.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
EPOCHS_FILE = "epochs.jsonl"
RESULT_FILE = "result.json"


class JournalError(OSError):
    """A run-directory file could not be written; the message names it and what to do."""


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    try:
        yield
    except JournalError:
        raise
    except OSError as exc:
        hint = (
            ": the disk is full; free space there, then run the same command again to resume"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else ""
        )
        raise JournalError(exc.errno, f"cannot write {path}: {exc.strerror or exc}{hint}") from None


FILE_MODE = 0o600
"""Mode of every file the journal writes: run.json names the endpoint and run id, and nobody
but the run's owner needs to read any of them."""


def _open_private(path: Path, mode: str) -> Any:
    """Open ``path`` for writing with mode 0600 (also when it already existed with another)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return open(fd, mode, encoding="utf-8")


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with _writing(path), _open_private(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    with _writing(path):
        os.replace(tmp, path)


class Journal:
    """Appends a run's records to its run directory (created if missing)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._epochs = _open_private(run_dir / EPOCHS_FILE, "a")

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the epoch journal with ``records`` (on resume: drop what was not committed)."""
        self._epochs.close()
        path = self.run_dir / EPOCHS_FILE
        tmp = path.with_name(path.name + ".tmp")
        with _open_private(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._epochs = _open_private(path, "a")

    def start(self, info: dict[str, Any]) -> None:
        _write_atomic(self.run_dir / RUN_FILE, info)

    def epoch(self, record: dict[str, Any]) -> None:
        """Append one record (``kind`` epoch or checkpoint) and make it durable."""
        with _writing(self.run_dir / EPOCHS_FILE):
            self._epochs.write(json.dumps(record, sort_keys=True) + "\n")
            self._epochs.flush()
            os.fsync(self._epochs.fileno())

    def result(self, info: dict[str, Any]) -> None:
        _write_atomic(self.run_dir / RESULT_FILE, info)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a failed flush was reported when it failed
            self._epochs.close()


def check_record(record: Any) -> None:
    """Raise ValueError saying what is wrong unless ``record`` is a well-formed journal record."""
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object, this is a {type(record).__name__}")
    kind = record.get("kind")
    if kind not in ("epoch", "checkpoint"):
        raise ValueError(f"kind is {kind!r}, not 'epoch' or 'checkpoint'")
    _field(record, "epoch", int)
    if record["epoch"] < 0:
        raise ValueError(f"epoch is {record['epoch']}, below 0")
    if kind == "epoch":
        _field(record, "train_loss", float)
        _field(record, "valid_loss", float, optional=True)
        _field(record, "validates", bool)


def _field(record: dict[str, Any], name: str, tp: type, *, optional: bool = False) -> None:
    if name not in record:
        raise ValueError(f"field {name!r} is missing")
    value = record[name]
    if value is None and optional:
        return
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"field {name!r} is {value!r}, not a {tp.__name__}")
