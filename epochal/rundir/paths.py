"""What a run directory holds, by name, and how much of each file a reader takes.

The coordinator writes these files (:mod:`epochal.coordinator.serve.journal`, the observers of
:mod:`epochal.observe`); ``epochal status``, ``epochal plot`` and a resume read them. Both sides
name them here, so that the observers need nothing of the coordinator's and the layout of a run
directory is written down once. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RUN_FILE = "run.json"
"""The run's settings and where its coordinator listens; written at the start of each attempt."""

EPOCHS_FILE = "epochs.jsonl"
"""The journal: one record per decided epoch and per committed checkpoint, fsynced before the
workers hear of it. An epoch's ``smoothed_loss`` and ``best_loss`` are of the monitored value:
the loss, or the metric that run.json's ``config.monitor`` names (``accuracy``)."""

DEFAULT_MONITOR = "loss"
"""What a run monitors unless ``--monitor`` names a metric (and what a run recorded before
``--monitor`` existed monitored)."""

RESULT_FILE = "result.json"
"""How the run ended (finished or aborted)."""

MODEL_FILE = "model.json"
"""The digest of the run's model (and its parameters), to refuse a resume with another model."""

STATUS_FILE = "status.json"
"""Where every rank is, rewritten while the run goes (``epochal status``)."""

CURVE_FILE = "curve.png"
"""The learning curve, redrawn after each epoch."""

CHECKPOINTS_DIR = "checkpoints"
"""The default checkpoint directory, inside the run directory."""

JOURNAL_LIMIT = 64 << 20
"""The largest ``epochs.jsonl`` a reader takes (about 150,000 epochs): a file that big is not one
a run wrote, and reading it whole must not exhaust the reader's memory."""

RECORD_FILE_LIMIT = 16 << 20
"""The largest ``run.json``, ``result.json`` or ``model.json`` a reader takes."""

STATUS_LIMIT = 64 << 20
"""The largest ``status.json`` a reader takes (one row per rank: a few MiB at 10,000 ranks)."""


def monitor_of(config: Mapping[str, Any]) -> str:
    """The monitored value's name in a run's ``config`` (run.json's): ``loss`` when it names
    none, or something that is not a name."""
    name = config.get("monitor")
    if isinstance(name, str) and name.isidentifier() and name.isascii() and len(name) <= 64:
        return name
    return DEFAULT_MONITOR


def smoothed_label(monitor: str) -> str:
    """How the epoch line, ``epochal status`` and the plot name the smoothed monitored value:
    ``smoothed`` for the loss (beside the train and valid losses it is made of), ``smoothed
    accuracy`` for a metric."""
    return "smoothed" if monitor == DEFAULT_MONITOR else f"smoothed {monitor}"


def rate_label(lr: float | None, factor: float) -> str:
    """How the epoch line and ``epochal status`` show an epoch's learning rate: ``lr 0.05``, the
    rate the optimizer held, with the coordinator's factor when it is not 1 (``lr 0.025
    (x0.5)``); ``lr x0.5``, the factor alone, when no worker said the rate."""
    if lr is None:
        return f"lr x{factor:g}"
    return f"lr {lr:.4g}" + ("" if factor == 1 else f" (x{factor:g})")


def standing(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The journal's records that still stand, in order. A ``world`` record of epoch E says a new
    world did E again (from the start of E, or from a checkpoint before it): the ``epoch`` and
    ``checkpoint`` records of E and later written before it are gone from the run's history."""
    kept: list[dict[str, Any]] = []
    for record in records:
        if record.get("kind") == "world":
            again = record["epoch"]
            kept = [r for r in kept if r.get("kind") == "world" or r["epoch"] < again]
        kept.append(record)
    return kept
