"""What a run leaves in its run directory: ``run.json``, ``epochs.jsonl`` and ``result.json``.

Each epoch's line is written, flushed and fsynced before the coordinator sends the decision it
records, so the file never claims less than the workers were told.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RUN_FILE = "run.json"
EPOCHS_FILE = "epochs.jsonl"
RESULT_FILE = "result.json"


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Journal:
    """Appends a run's records to its run directory (created if missing)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._epochs = open(run_dir / EPOCHS_FILE, "a", encoding="utf-8")  # noqa: SIM115

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the epoch journal with ``records`` (on resume: drop what was not committed)."""
        self._epochs.close()
        path = self.run_dir / EPOCHS_FILE
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._epochs = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def start(self, info: dict[str, Any]) -> None:
        _write_atomic(self.run_dir / RUN_FILE, info)

    def epoch(self, record: dict[str, Any]) -> None:
        """Append one record (``kind`` epoch or checkpoint) and make it durable."""
        self._epochs.write(json.dumps(record, sort_keys=True) + "\n")
        self._epochs.flush()
        os.fsync(self._epochs.fileno())

    def result(self, info: dict[str, Any]) -> None:
        _write_atomic(self.run_dir / RESULT_FILE, info)

    def close(self) -> None:
        self._epochs.close()
