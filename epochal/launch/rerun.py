"""Continuing a run: which run ``--resume`` means, and the command line that resumes one.

A run started without ``--run-dir`` lives in ``runs/RUN_ID``, a new directory each time; the same
command again would start over. So ``--resume`` looks among the runs there for the newest one of
the same command (the same script and arguments; for ``epochal coordinator``, another coordinator
run) that the command can continue: one that has not finished, or one that finished by reaching
its epochs and is now given more. The newest is the one whose ``run.json`` was written last
(``started``, rewritten by each attempt). A new run started while such a run is there says so,
and an interrupted or failed run ends with :func:`resume_command`, the exact command that
continues it; a run stopped by a configuration or data error, which a resume would repeat, ends
with :data:`FIX_LINE` instead. Everything read here goes through
:mod:`epochal.observe.runfiles` (regular files only, within their size bounds); a directory that
cannot be read is passed over.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epochal.errors import ConfigError
from epochal.observe.runfiles import read_json
from epochal.rundir.paths import RESULT_FILE, RUN_FILE

GLOBAL_VALUE_OPTIONS = ("--log-level", "--log-format")
"""Options before the command name that take a value (``epochal --log-level debug run ...``)."""

DROPPED = ("--fresh", "--resume")
"""Switches a resume command leaves out: it puts its own ``--resume`` first, and ``--fresh``
would start the run over."""


@dataclass(frozen=True, slots=True)
class PreviousRun:
    """A run found in the directory of runs, as its files describe it."""

    run_dir: Path
    started: float
    # when its last attempt started (run.json), for "the newest"
    epochs: int | None
    # the epochs it was started with
    epochs_run: int | None
    # how many it ran, once it finished
    finished: bool

    def continued_by(self, epochs: int) -> bool:
        """Whether a command with ``epochs`` continues this run: it has not finished, or it ran
        all its epochs and ``epochs`` is more."""
        if not self.finished:
            return True
        return self.epochs is not None and self.epochs_run == self.epochs < epochs


def _shown(command: Sequence[str] | None) -> str:
    return "the coordinator" if command is None else f"`{shlex.join(command)}`"


def previous_runs(runs: Path, command: Sequence[str] | None) -> list[PreviousRun]:
    """The runs in ``runs`` (one directory each) of ``command`` (the workers' script and
    arguments as :func:`~epochal.coordinator.serve.resume.script_identity` records them; None for
    ``epochal coordinator``), newest first."""
    wanted = None if command is None else list(command)
    found = []
    try:
        entries = sorted(os.scandir(runs), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        try:
            run = read_json(Path(entry.path) / RUN_FILE)
            result = read_json(Path(entry.path) / RESULT_FILE)
        except ConfigError:  # a link or an oversized file: not a run this user's epochal wrote
            continue
        config = run.get("config") if run is not None else None
        if not isinstance(config, dict) or config.get("command") != wanted:
            continue
        assert run is not None
        found.append(
            PreviousRun(
                run_dir=Path(entry.path),
                started=_number(run.get("started")),
                epochs=_integer(config.get("epochs")),
                epochs_run=_integer((result or {}).get("epochs_run")),
                finished=(result or {}).get("status") == "finished",
            )
        )
    return sorted(found, key=lambda r: r.started, reverse=True)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _integer(value: Any) -> int | None:
    return value if type(value) is int else None


def run_to_resume(runs: Path, command: Sequence[str] | None, epochs: int) -> Path:
    """The run directory ``--resume`` continues: the newest run of ``command`` in ``runs`` that
    a command with ``epochs`` continues (:meth:`PreviousRun.continued_by`); a ConfigError saying
    what there is otherwise."""
    runs_of = previous_runs(runs, command)
    for run in runs_of:
        if run.continued_by(epochs):
            return run.run_dir
    what = _shown(command)
    if not runs_of:
        raise ConfigError(
            f"--resume: {runs} holds no run of {what}: leave out --resume to start one, or "
            "pass --run-dir the directory of the run to continue"
        )
    newest = runs_of[0]
    raise ConfigError(
        f"--resume: every run of {what} in {runs} has finished; the newest, {newest.run_dir}, "
        f"after {newest.epochs_run} epochs: pass a larger --epochs to train it further, or "
        "leave out --resume to start a new run"
    )


def unfinished_run(runs: Path, command: Sequence[str] | None) -> Path | None:
    """The newest run of ``command`` in ``runs`` that has not finished, if any."""
    for run in previous_runs(runs, command):
        if not run.finished:
            return run.run_dir
    return None


def require_run(run_dir: Path) -> None:
    """``--resume --run-dir DIR``: DIR must hold a run (its run.json)."""
    if not os.path.lexists(run_dir / RUN_FILE):
        raise ConfigError(
            f"--resume: {run_dir} holds no run to continue (no {RUN_FILE}): leave out --resume "
            "to start one there"
        )


def program() -> str:
    """How this process was started, to be started again: ``epochal``, or this Python's ``-m
    epochal``."""
    if Path(sys.argv[0]).name == "epochal":
        return "epochal"
    return f"{shlex.quote(sys.executable)} -m epochal"


def resume_command(argv: Sequence[str], run_dir: Path, *, tail: int = 0) -> str:
    """The command line that continues the run in ``run_dir``: ``argv`` (the arguments after
    the program, as given) with ``--resume --run-dir DIR`` after the command name, and no
    ``--fresh``, ``--resume`` or ``--run-dir`` of its own. The last ``tail`` arguments (the
    script and its arguments) are kept as they are."""
    words = list(argv)
    start = 0
    while start < len(words) and words[start].startswith("-"):
        start += 2 if words[start] in GLOBAL_VALUE_OPTIONS else 1
    end = len(words) - tail
    if start >= end:
        return ""  # not a command line this module knows how to read
    options: list[str] = []
    skip = False
    for word in words[start + 1 : end]:
        if skip:
            skip = False
        elif word == "--run-dir":
            skip = True
        elif word not in DROPPED and not word.startswith("--run-dir="):
            options.append(word)
    line = [*words[: start + 1], "--resume", "--run-dir", str(run_dir), *options, *words[end:]]
    return f"{program()} {shlex.join(line)}"


FIX_LINE = (
    "to fix: the configuration or data error the reason above names (a resume would stop on it "
    "again); once it is fixed, the same command runs"
)
"""The last line of a run stopped by a configuration or data error: the reason, said once just
above, names what to change; a resume command would only repeat the error."""
