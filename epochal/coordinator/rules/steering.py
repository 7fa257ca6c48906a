"""Settings that only steer decisions still to come (``--patience``, ``--min-delta``,
``--checkpoint-every``): what a resume that changes them records and says, and how the epochs
decided before the change are replayed under the values they were decided with. Also what a run
given more epochs records and says when its learning-rate schedule spans them: it continues on the
curve over the new count, or, with ``--keep-schedule``, keeps the curve it had and holds its last
factor (run.json's ``extended`` records the span kept, so that every later resume keeps it too)."""

from __future__ import annotations

import dataclasses
from typing import Any

from epochal.cli.settings import settings
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.carry import replay
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.schedule import Schedule

_SETTINGS = settings(CoordinatorConfig)

STEERS = frozenset(name for name, s in _SETTINGS.items() if s.on_resume == "steers")
"""Settings that only steer decisions still to come: a resume may change them from the epoch it
starts at (:func:`steered`), and the epochs before it are replayed under the values they were
decided with."""


def _plain(value: Any) -> str:
    """A setting's value as a person reads it: ``not set`` for an option left out."""
    return "not set" if value is None else str(value)


def steered(stored: dict[str, Any], current: dict[str, Any], at_epoch: int) -> list[dict[str, Any]]:
    """The settings that only steer what comes next (:data:`STEERS`) which this resume changes,
    each as the record run.json keeps: ``setting``, ``from``, ``to`` and ``at_epoch``, the first
    epoch decided under the new value."""
    return [
        {"setting": key, "from": stored.get(key), "to": current.get(key), "at_epoch": at_epoch}
        for key in sorted(STEERS)
        if key in stored and stored.get(key) != current.get(key)
    ]


def steered_line(change: dict[str, Any]) -> str:
    """What a resume says of one change :func:`steered` found: ``patience: not set -> 5 from
    epoch 9``."""
    name = str(change["setting"]).replace("_", "-")
    return (
        f"{name}: {_plain(change['from'])} -> {_plain(change['to'])} "
        f"from epoch {change['at_epoch']}"
    )


def steered_before(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The changes earlier resumes made (run.json's ``steered``), well-formed ones only."""
    listed = run.get("steered")
    if not isinstance(listed, list):
        return []
    return [
        c
        for c in listed
        if isinstance(c, dict) and c.get("setting") in STEERS and type(c.get("at_epoch")) is int
    ]


def in_effect(stored: dict[str, Any], changes: list[dict[str, Any]], epoch: int) -> dict[str, Any]:
    """The value of each steering setting the epochs before ``epoch`` were decided under: the
    last of ``changes`` made before it, else the value the run started with (the first change's
    ``from``), else the ``stored`` one. A change from ``epoch`` on was made by a resume whose
    epochs are done again now: it no longer stands."""
    values = dict(stored)
    for key in STEERS:
        mine = sorted((c for c in changes if c["setting"] == key), key=lambda c: c["at_epoch"])
        if mine:
            values[key] = mine[0]["from"]
        for change in mine:
            if change["at_epoch"] < epoch:
                values[key] = change["to"]
    return values


def replay_steered(
    loop: LoopState, records: list[dict[str, Any]], changes: list[dict[str, Any]]
) -> None:
    """Replay ``records`` into ``loop`` (built with today's settings), each epoch under the
    value of every steering setting it was decided with: the first change's ``from`` before it,
    each change's ``to`` from its ``at_epoch`` on; today's values after the last record."""
    final = {key: getattr(loop, key) for key in STEERS if hasattr(loop, key)}
    ordered = sorted(changes, key=lambda c: c["at_epoch"])
    for key in final:
        first = next((c for c in ordered if c["setting"] == key), None)
        if first is not None:
            setattr(loop, key, first["from"])
    for record in records:
        while ordered and record["epoch"] >= ordered[0]["at_epoch"]:
            change = ordered.pop(0)
            if change["setting"] in final:
                setattr(loop, change["setting"], change["to"])
        replay(loop, [record])
    for key, value in final.items():
        setattr(loop, key, value)


def extension(
    config: CoordinatorConfig,
    earlier: list[dict[str, Any]],
    more: tuple[int, int],
    start: int,
    had_finished: bool,
) -> dict[str, Any]:
    """What run.json's ``extended`` keeps of a resume that gives the run more epochs (``more``:
    before, now) from epoch ``start``. With ``--keep-schedule`` and a schedule that spans the
    epochs, also ``kept_span``: the epochs its curve is kept over (what an ``earlier`` one kept,
    else the epochs the run had)."""
    record: dict[str, Any] = {
        "from_epochs": more[0],
        "to_epochs": more[1],
        "at_epoch": start,
        "had_finished": had_finished,
    }
    if config.keep_schedule and config.schedule.spans_epochs:
        record["kept_span"] = kept_span(earlier) or more[0]
    return record


def kept_span(extensions: list[dict[str, Any]]) -> int | None:
    """The epochs the run's schedule keeps its curve over: the last extension's ``kept_span``;
    None when the last one kept none (or the run was never given more epochs)."""
    span = extensions[-1].get("kept_span") if extensions else None
    return span if type(span) is int and span >= 1 else None


def schedule_of(config: CoordinatorConfig, extensions: list[dict[str, Any]]) -> Schedule:
    """The run's schedule: over ``--epochs``, or over the span an extension kept, its last
    factor held after it (:func:`kept_span`)."""
    span = kept_span(extensions)
    schedule = config.schedule
    return schedule if span is None else dataclasses.replace(schedule, epochs=span, held=True)


def schedule_jump(
    loop: LoopState, kept: list[dict[str, Any]], more: tuple[int, int], start: int
) -> str | None:
    """What a run given more epochs (``more``: before, now) says when its learning-rate schedule
    spans ``--epochs``: the factor the old curve gave ``start``, the one it has now (``loop``
    replayed), and why; None when the schedule does not span them."""
    schedule = loop.schedule
    decided = [r for r in kept if r["kind"] == "epoch"]
    if schedule is None or not schedule.spans_epochs or not decided:
        return None
    before = decided[-1].get("next_lr_factor")
    if not isinstance(before, int | float) or isinstance(before, bool):
        return None
    said = (
        f"learning-rate factor {before:.4g} -> {loop.lr_factor:.4g} at epoch {start}: the "
        f"{schedule.spec} schedule spans --epochs, now {more[1]} where it was {more[0]}, so the "
    )
    if schedule.held:
        return said + (
            f"run keeps its curve over {schedule.epochs} epochs (--keep-schedule) and holds its "
            "last factor for the epochs added"
        )
    return said + "run continues on the curve over the new count"
