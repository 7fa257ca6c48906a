"""The run's model as the run directory records it (``model.json``): a resume with another model
is refused naming the first entry that differs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from epochal.coordinator.rules.models import describe_difference, describe_fingerprints
from epochal.protocol import Fingerprint, ParamSpec
from epochal.rundir.files import read_regular, write_atomic
from epochal.rundir.paths import MODEL_FILE

MODEL_FILE_LIMIT = 64 * 1024 * 1024
"""Largest model.json read back (MAX_PARAMS entries with long names take a few tens of MiB)."""


class ModelFile:
    """The run's model as ``model.json`` in the run directory records it: its fingerprint and,
    when they could be had, its entries, so that a resume with another model is refused naming
    the first entry that differs.

    The workers' hellos carry only fingerprints, so the entries come from a worker asked for them
    (:mod:`.models`); :meth:`needs_list` says when they are needed, :meth:`check` compares or
    records.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / MODEL_FILE

    def needs_list(self, fingerprint: Fingerprint) -> bool:
        """Whether a worker's entries are needed: to record the model (no model.json yet), or
        to name how it differs from the recorded one (same torch version, another digest)."""
        try:
            stored, params = self._read()
        except FileNotFoundError:
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False  # check() says it is unreadable
        if stored.digest == fingerprint.digest:
            return False
        return stored.torch_version == fingerprint.torch_version and params is not None

    def check(
        self, fingerprint: Fingerprint, params: Sequence[ParamSpec] | None = None
    ) -> str | None:
        """Record the run's model (with ``params``, the workers' entries, when given), or say how
        it differs from the one recorded: by its first differing entry when both lists are
        known, else by torch version or digest."""
        try:
            stored, stored_params = self._read()
        except FileNotFoundError:
            self._write(fingerprint, params)
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{self.path} is unreadable ({exc}): use another --run-dir, or --fresh"
        if stored.digest == fingerprint.digest:
            return None
        theirs, ours = "the run directory's model", "the workers' model"
        if stored_params is not None and params is not None:
            diff = describe_difference(stored_params, params, theirs, ours)
        else:
            diff = describe_fingerprints(stored, fingerprint, theirs, ours)
        return (
            f"the run directory {self.run_dir} holds a run of another model: {diff}; use another "
            "--run-dir for this model, or --fresh to replace that run"
        )

    def _read(self) -> tuple[Fingerprint, tuple[ParamSpec, ...] | None]:
        data = json.loads(read_regular(self.path, MODEL_FILE_LIMIT))
        if not isinstance(data, dict):
            raise TypeError(f"it holds a {type(data).__name__}, not an object")
        listed = data.get("params")
        params = (
            None
            if listed is None
            else tuple(
                ParamSpec(name=p["name"], shape=tuple(p["shape"]), dtype=p["dtype"]) for p in listed
            )
        )
        # written before fingerprints counted their entries: the list's length
        entries = data["entries"] if "entries" in data or params is None else len(params)
        fingerprint = Fingerprint(
            digest=data["digest"], torch_version=data["torch_version"], entries=entries
        )
        return fingerprint, params

    def _write(self, fingerprint: Fingerprint, params: Sequence[ParamSpec] | None) -> None:
        record: dict[str, Any] = asdict(fingerprint)
        if params is not None:
            record["params"] = [asdict(p) for p in params]
        write_atomic(self.path, json.dumps(record))
