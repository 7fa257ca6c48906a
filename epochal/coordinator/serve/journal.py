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

from epochal.rundir.files import open_append, private_dir, write_atomic
from epochal.rundir.paths import EPOCHS_FILE, RESULT_FILE, RUN_FILE


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


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


class Journal:
    """Appends a run's records to its run directory (created 0700 if missing, refused if another
    user could write in it).

    Every file is written without following a link: ``run.json`` and ``result.json`` through a
    temporary file made exclusively under an unguessable name and renamed into place,
    ``epochs.jsonl`` appended only when it is a regular file of this user's (see
    :mod:`epochal.rundir.files`); each is mode 0600, since run.json names the endpoint and the run
    id.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = private_dir(run_dir, kind="run directory")
        with _writing(run_dir / EPOCHS_FILE):
            self._epochs = open_append(run_dir / EPOCHS_FILE)

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the epoch journal with ``records`` (on resume: drop what was not committed)."""
        self._epochs.close()
        path = self.run_dir / EPOCHS_FILE
        with _writing(path):
            write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
            self._epochs = open_append(path)

    def start(self, info: dict[str, Any]) -> None:
        with _writing(self.run_dir / RUN_FILE):
            write_atomic(self.run_dir / RUN_FILE, _dump(info))

    def epoch(self, record: dict[str, Any]) -> None:
        """Append one record (``kind`` epoch or checkpoint) and make it durable."""
        with _writing(self.run_dir / EPOCHS_FILE):
            self._epochs.write(json.dumps(record, sort_keys=True) + "\n")
            self._epochs.flush()
            os.fsync(self._epochs.fileno())

    def result(self, info: dict[str, Any]) -> None:
        with _writing(self.run_dir / RESULT_FILE):
            write_atomic(self.run_dir / RESULT_FILE, _dump(info))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a failed flush was reported when it failed
            self._epochs.close()


def check_record(record: Any) -> None:
    """Raise ValueError saying what is wrong unless ``record`` is a well-formed journal record."""
    if not isinstance(record, dict):
        raise ValueError(f"a record is a JSON object, this is a {type(record).__name__}")
    kind = record.get("kind")
    if kind not in ("epoch", "checkpoint", "world", "go"):
        raise ValueError(f"kind is {kind!r}, not 'epoch', 'checkpoint', 'world' or 'go'")
    _field(record, "epoch", int)
    if record["epoch"] < 0:
        raise ValueError(f"epoch is {record['epoch']}, below 0")
    if kind == "world":  # a change of the world before this epoch was (re)done
        for name in ("generation", "from", "to"):
            _field(record, name, int)
        return
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
