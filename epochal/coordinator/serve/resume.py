"""Reading a run directory back: is there a run to resume, where, and with what loop state?

A run directory holds ``run.json`` (the configuration), ``epochs.jsonl`` (one ``epoch`` record per
decided epoch and one ``checkpoint`` record per committed checkpoint, each fsynced before the
workers heard of it) and, once the run ended, ``result.json``. Resuming replays the epoch records
up to the newest committed checkpoint that verifies against its manifest through
:class:`~epochal.coordinator.rules.batches.LoopState`, which rebuilds the smoothing state, best
epoch,
learning-rate factor and patience exactly. A larger ``--epochs`` than the run's trains it
further, also once it finished by reaching its epochs: it resumes after its last checkpoint, and
run.json (then result.json) lists each time under ``extended``. No torch here: checkpoints are
checked by their manifest (its MAC under the user's checkpoint key, then every file's SHA-256),
not loaded; a checkpoint directory another user could write is refused.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from epochal.cli.settings import flag_name, settings
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.actions import RunSummary
from epochal.coordinator.rules.carry import carry_from
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.outcome import EpochOutcome
from epochal.coordinator.rules.runstate import RunState
from epochal.coordinator.rules.steering import (
    STEERS,
    extension,
    in_effect,
    replay_steered,
    schedule_jump,
    schedule_of,
    steered,
    steered_before,
)
from epochal.coordinator.serve.attempts import workers_id
from epochal.coordinator.serve.directories import check_directories
from epochal.coordinator.serve.journal import check_record
from epochal.errors import ConfigError
from epochal.rundir.checkpointkey import CheckpointKey, load_key
from epochal.rundir.files import NotRegular, read_regular
from epochal.rundir.manifest import checkpoint_path, file_digest, verify_checkpoint
from epochal.rundir.paths import (
    EPOCHS_FILE,
    JOURNAL_LIMIT,
    MODEL_FILE,
    RECORD_FILE_LIMIT,
    RESULT_FILE,
    RUN_FILE,
    standing,
)
from epochal.text import printable

_SETTINGS = settings(CoordinatorConfig)

_MAY_CHANGE = {name for name, s in _SETTINGS.items() if s.on_resume == "may_change"}
"""Settings that may change between a run and its resumption without changing its result."""

_WHEN_KNOWN = {name for name, s in _SETTINGS.items() if s.on_resume == "when_known"}
"""Settings compared only when both the run and the resume know them (a run directory written
before they were recorded, or workers started by hand, leave them unknown)."""

_MAY_GROW = {name for name, s in _SETTINGS.items() if s.on_resume == "may_grow"}
"""Settings a resume may raise (the run is trained further) but not lower."""


def _called(key: str) -> str:
    """How a refused resume names the setting ``key``: its flag, unless it says otherwise."""
    spec = _SETTINGS.get(key)
    if spec is not None and spec.called is not None:
        return spec.called
    negated = spec is not None and spec.flag is not None and spec.flag.negated
    return flag_name(key, negated=negated)


def script_identity(script: str, args: list[str], *, module: bool) -> dict[str, Any]:
    """The ``command`` and ``script_digest`` settings of workers running ``script args``."""
    if module:
        return {"command": ("-m", script, *args), "script_digest": None}
    path = Path(script).resolve()
    return {"command": (str(path), *args), "script_digest": file_digest(path)}


def config_record(config: CoordinatorConfig) -> dict[str, Any]:
    """The configuration as stored in run.json (no secrets)."""
    return {
        k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
        for k, v in asdict(config).items()
        if k != "token"
    }


def _shown(key: str, value: Any) -> str:
    if value is None:  # an option left out: no Python None in what a person reads
        return "not set"
    if key == "command" and isinstance(value, list):
        return repr(shlex.join(str(a) for a in value))
    return repr(value)


def grown(stored: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The settings a resume raises that may grow, as ``name: (the run's, now)``."""
    out = {}
    for key in _MAY_GROW:
        then, now = stored.get(key), current.get(key)
        if type(then) is int and type(now) is int and now > then:
            out[key] = (then, now)
    return out


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Settings that differ between a stored run and the command line, as readable phrases (a
    setting that may grow and did is not one: see :func:`grown`)."""
    out = []
    for key in sorted(set(stored) | set(current)):
        if key in _MAY_CHANGE or key in STEERS or key in grown(stored, current):
            continue
        if key in _WHEN_KNOWN and (stored.get(key) is None or current.get(key) is None):
            continue
        if stored.get(key) != current.get(key):
            flag = _called(key)
            now, then = _shown(key, current.get(key)), _shown(key, stored.get(key))
            shorter = " (a run may be given more, never fewer)" if key in _MAY_GROW else ""
            out.append(f"{flag} is {now} now but {then} in the run{shorter}")
    return out


def _read(path: Path, limit: int, what: str) -> bytes | None:
    """The bytes of the run directory's file ``path``; None when it is missing; ConfigError
    naming it when it is a link, not a regular file or over ``limit`` bytes."""
    try:
        return read_regular(path, limit)
    except FileNotFoundError:
        return None
    except NotRegular as exc:
        raise ConfigError(
            f"{what} {path} cannot be read: {exc}. A run writes only regular files there; "
            "remove it (or start over with --fresh), or use another --run-dir"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def _read_journal(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    raw = _read(path, JOURNAL_LIMIT, "the journal")
    if raw is None:
        return []
    lines = raw.split(b"\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = number == len(lines)  # no newline after it: the write was cut off
        try:
            record = json.loads(line)
            check_record(record)
        except (ValueError, RecursionError) as exc:
            if last:
                notes.append(
                    f"ignored a half-written last line in {path} (the run was killed "
                    "while writing it)"
                )
                break
            raise ConfigError(
                f"the journal {path} is corrupt at line {number} ({printable(exc)}): restore it "
                "from a backup, or start the run over with --fresh"
            ) from None
        records.append(record)
    return records


def _refuse_orphan_journal(run_dir: Path) -> None:
    """A journal without its run.json: never start over on top of it (that would wipe it)."""
    journal = run_dir / EPOCHS_FILE
    raw = _read(journal, JOURNAL_LIMIT, "the journal")
    if raw:
        raise ConfigError(
            f"{run_dir / RUN_FILE} is missing, but {journal} holds the epochs of a run: restore "
            "run.json to resume that run, use another --run-dir, or pass --fresh to start over "
            "(which deletes the journal and checkpoints)"
        )


def _stored_run(run_dir: Path) -> dict[str, Any] | None:
    """What run.json holds (its ``config`` checked to be an object); None when there is none."""
    path = run_dir / RUN_FILE
    raw = _read(path, RECORD_FILE_LIMIT, "the run's settings")
    if raw is None:
        return None
    try:
        run = json.loads(raw)
        stored = run["config"]
        if not isinstance(stored, dict):
            raise TypeError(f"its config is a {type(stored).__name__}, not an object")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ConfigError(
            f"{path} is unreadable ({printable(exc)}): it is not an epochal run directory, or "
            "it is damaged; use another --run-dir or start over with --fresh"
        ) from None
    return dict(run)


def _extensions(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The times run.json says the run was given more epochs (see :class:`RunState`)."""
    listed = run.get("extended")
    if not isinstance(listed, list):
        return []
    return [entry for entry in listed if isinstance(entry, dict)]


def _check_extendable(run_dir: Path, records: list[dict[str, Any]], epochs: int) -> None:
    """Refuse more epochs for a finished run that did not stop by reaching its ``epochs``: its
    early stopping or its schedule would stop it again at once."""
    decided = [r for r in records if r["kind"] == "epoch"]
    last = decided[-1] if decided else {}
    if last.get("stop_reason") == "epochs":
        return
    why = {
        "patience": "--patience stopped it early",
        "lr_factor": "its learning-rate factor reached 0",
    }.get(str(last.get("stop_reason")), "it stopped early")
    raise ConfigError(
        f"the run in {run_dir} finished after {len(decided)} of its {epochs} epochs ({why}): "
        "more --epochs would not train it further; pass --fresh to start it over"
    )


def last_world_size(records: list[dict[str, Any]]) -> int | None:
    """How many workers trained the last epoch ``records`` hold (None: none, or a journal
    written before epochs recorded it)."""
    for record in reversed(records):
        if record.get("kind") == "epoch":
            size = record.get("world_size")
            return size if type(size) is int else None
    return None


def _finished(run_dir: Path) -> dict[str, Any] | None:
    """result.json of a run that finished; None otherwise (no result, or an abort's)."""
    raw = _read(run_dir / RESULT_FILE, RECORD_FILE_LIMIT, "the run's result")
    try:
        result = {} if raw is None else json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if isinstance(result, dict) and result.get("status") == "finished":
        return result
    return None


def _last_usable(checkpoint_dir: Path | None, committed: list[int], notes: list[str]) -> int | None:
    """The last of the ``committed`` epochs whose checkpoint in ``checkpoint_dir`` is usable (or
    cannot be seen from here); a note on each one found unusable on the way."""
    key: CheckpointKey | None = None
    for epoch in reversed(committed):
        if checkpoint_dir is None:
            return None
        path = checkpoint_path(checkpoint_dir, epoch)
        if not path.exists() and not checkpoint_dir.exists():
            return epoch  # not visible from here (another machine's disk): trust the journal
        key = key or load_key()
        problem = verify_checkpoint(path, key, epoch=epoch)
        if problem is None:
            return epoch
        notes.append(
            f"the checkpoint of epoch {epoch} is unusable: {problem}; falling back to "
            "the previous one"
        )
    return None


def inspect(config: CoordinatorConfig, checkpoint_dir: Path | None) -> RunState:
    """Read ``config.run_dir`` and decide where the run starts; ConfigError when it cannot.

    Every file is read only when it is a regular file within its size bound (never through a
    link, never blocking on a FIFO): a refusal names the file."""
    check_directories(None, checkpoint_dir)
    run = None if config.run_dir is None else _stored_run(config.run_dir)
    state = _inspect(config, checkpoint_dir, run)
    state.run_file = run
    return state


def _inspect(
    config: CoordinatorConfig, checkpoint_dir: Path | None, run: dict[str, Any] | None
) -> RunState:
    """:func:`inspect`, once run.json was read (``run``: None when there is none)."""
    run_dir = config.run_dir
    loop = LoopState.from_config(config)
    if run_dir is None:
        return RunState(loop=loop)
    if run is None:
        _refuse_orphan_journal(run_dir)
        return RunState(loop=loop)
    stored, current = run["config"], config_record(config)
    diff = differences(stored, current)
    if diff:
        raise ConfigError(
            f"the run directory {run_dir} holds a run with other settings: {'; '.join(diff)}. "
            "Pass the same options to resume it, or --fresh to start it over"
        )
    more = grown(stored, current).get("epochs")
    extensions = _extensions(run)
    notes: list[str] = []
    result = _finished(run_dir)
    if result is not None and more is None:
        return RunState(loop=loop, finished=result, extensions=extensions)
    records = standing(_read_journal(run_dir / EPOCHS_FILE, notes))
    if result is not None and more is not None:
        _check_extendable(run_dir, records, more[0])
    committed = [r["epoch"] for r in records if r["kind"] == "checkpoint"]
    resume = _last_usable(checkpoint_dir, committed, notes)
    if result is not None and resume is None:
        raise ConfigError(
            f"the run in {run_dir} finished, but it kept no usable checkpoint to train it further "
            f"from{' (' + '; '.join(notes) + ')' if notes else ''}: pass --fresh to train it "
            "over from epoch 0"
        )
    kept = [r for r in records if resume is not None and r["epoch"] <= resume]
    start = 0 if resume is None else resume + 1
    earlier = steered_before(run)
    standing_changes = [c for c in earlier if c["at_epoch"] < start]
    now_steered = steered(in_effect(stored, earlier, start), current, start)
    steered_all = standing_changes + now_steered
    extended_from = None if more is None else more[0]
    if more is not None:
        extensions = [*extensions, extension(config, extensions, more, start, result is not None)]
    loop.schedule = schedule_of(config, extensions)  # kept by --keep-schedule, or over --epochs
    replay_steered(loop, kept, steered_all)
    if more is not None and kept:
        jump = schedule_jump(loop, kept, more, start)
        if jump is not None:
            notes.append(jump)
    if resume is None and records:
        notes.append("no usable checkpoint: the run starts again from epoch 0")
    return RunState(
        loop=loop,
        resume_epoch=resume,
        records=kept,
        notes=notes,
        extended_from=extended_from,
        extensions=extensions,
        steered=steered_all,
        steered_now=now_steered,
        # running workers are taken back only to go on as they were decided
        carry=None
        if more is not None or now_steered
        else carry_from(config, records, workers_id(run), loop.schedule),
    )


def start_fresh(config: CoordinatorConfig, checkpoint_dir: Path | None) -> None:
    """Forget what the run directory holds (journal, result, checkpoints) so the run starts over.

    Only in directories :func:`~.directories.check_directories` accepts (checked here again),
    and never through a link: a link at one of the names is removed, not followed, and
    ``rmtree`` does not descend into links."""
    run_dir = config.run_dir
    if run_dir is None:
        return
    check_directories(run_dir, checkpoint_dir)
    for name in (RUN_FILE, EPOCHS_FILE, RESULT_FILE, MODEL_FILE):
        (run_dir / name).unlink(missing_ok=True)
    if checkpoint_dir is not None and os.path.lexists(checkpoint_dir):
        shutil.rmtree(checkpoint_dir)


def decided_epochs(run_dir: Path) -> list[EpochOutcome]:
    """The decided epochs a finished run's journal holds (lines that do not read are skipped:
    the run is over, and its result.json says how it ended)."""
    try:
        raw = read_regular(run_dir / EPOCHS_FILE, JOURNAL_LIMIT)
    except OSError:
        return []
    records = []
    for line in raw.splitlines():
        try:
            record = json.loads(line)
            check_record(record)
        except (ValueError, RecursionError):
            continue
        records.append(record)
    history = []
    for record in standing(records):
        try:
            if record["kind"] == "epoch":
                history.append(EpochOutcome.from_record(record))
        except (ValueError, TypeError, KeyError):
            continue
    return history


def finished_summary(
    config: CoordinatorConfig, done: dict[str, Any], run_id: str
) -> tuple[str, RunSummary]:
    """What a coordinator says and returns for a run directory whose run already finished
    (``done``: its result.json): nothing is left to train."""
    assert config.run_dir is not None, "only a run directory holds a finished run"
    line = (
        f"the run in {config.run_dir} already finished after {done.get('epochs_run')} epochs "
        f"(best epoch {done.get('best_epoch')}); nothing to train. Pass a larger --epochs to "
        "train it further, or --fresh to train it again"
    )
    summary = RunSummary(
        run_id=str(done.get("run_id", run_id)),
        best_epoch=done.get("best_epoch"),
        best_loss=done.get("best_loss"),
        epochs_run=int(done.get("epochs_run", 0)),
        history=decided_epochs(config.run_dir),
    )
    return line, summary
