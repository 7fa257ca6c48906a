"""Which run ``--resume`` continues, and the command line an unfinished run ends with
(epochal/launch/rerun.py), on run directories written as a run leaves them."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from epochal.cli.parser import build_parser
from epochal.errors import ConfigError
from epochal.launch import rerun
from epochal.launch.rerun import previous_runs, resume_command, run_to_resume, unfinished_run

SCRIPT = ["/work/train.py", "--lr", "0.1"]


def write_run(
    runs: Path,
    name: str,
    *,
    started: float,
    command: list[str] | None = SCRIPT,
    epochs: int = 10,
    result: dict[str, Any] | None = None,
) -> Path:
    """A run directory as the coordinator leaves it: run.json, and result.json once it ended."""
    run_dir = runs / name
    run_dir.mkdir(parents=True, mode=0o700)
    config = {"command": command, "epochs": epochs, "run_dir": str(run_dir)}
    (run_dir / "run.json").write_text(json.dumps({"started": started, "config": config}))
    if result is not None:
        (run_dir / "result.json").write_text(json.dumps(result))
    return run_dir


def finished(epochs_run: int) -> dict[str, Any]:
    return {"status": "finished", "run_id": "r", "epochs_run": epochs_run}


ABORTED = {"status": "aborted", "run_id": "r", "reason": "the launcher received SIGINT"}


# ----------------------------------------------------------------------------- --resume


def test_resume_takes_the_newest_unfinished_run_of_the_same_command(tmp_path: Path):
    runs = tmp_path / "runs"
    write_run(runs, "a", started=100.0, result=ABORTED)
    newest = write_run(runs, "b", started=300.0)  # killed: no result at all
    write_run(runs, "c", started=400.0, result=finished(10))  # newer, but over
    write_run(runs, "d", started=500.0, command=[*SCRIPT[:2], "0.2"])  # other arguments
    write_run(runs, "e", started=600.0, command=None)  # a coordinator's
    assert run_to_resume(runs, SCRIPT, epochs=10) == newest
    assert unfinished_run(runs, SCRIPT) == newest
    assert unfinished_run(runs, None) == runs / "e"
    assert [r.run_dir.name for r in previous_runs(runs, SCRIPT)] == ["c", "b", "a"]


def test_resume_with_more_epochs_takes_the_newest_run_that_reached_its_own(tmp_path: Path):
    runs = tmp_path / "runs"
    write_run(runs, "a", started=100.0, result=ABORTED)
    reached = write_run(runs, "b", started=200.0, epochs=10, result=finished(10))
    write_run(runs, "c", started=300.0, epochs=10, result=finished(6))  # stopped early
    assert run_to_resume(runs, SCRIPT, epochs=20) == reached
    assert run_to_resume(runs, SCRIPT, epochs=10) == runs / "a"  # the same count: unfinished


def test_resume_with_nothing_to_continue_says_what_there_is(tmp_path: Path):
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError) as none:
        run_to_resume(runs, SCRIPT, epochs=10)
    assert f"--resume: {runs} holds no run of `/work/train.py --lr 0.1`" in str(none.value)
    assert "leave out --resume to start one" in str(none.value)
    write_run(runs, "a", started=100.0, result=finished(10))
    with pytest.raises(ConfigError) as over:
        run_to_resume(runs, SCRIPT, epochs=10)
    message = str(over.value)
    assert f"every run of `/work/train.py --lr 0.1` in {runs} has finished" in message
    assert f"the newest, {runs / 'a'}, after 10 epochs: pass a larger --epochs" in message


def test_resume_passes_over_what_no_run_of_this_users_epochal_wrote(tmp_path: Path):
    runs = tmp_path / "runs"
    real = write_run(runs, "a", started=100.0)
    (runs / "link").symlink_to(real)  # a link: never followed
    (runs / "loose-file").write_text("x")
    (runs / "empty").mkdir()
    (runs / "garbled").mkdir()
    (runs / "garbled" / "run.json").write_text("{")
    (runs / "fifo").mkdir()
    __import__("os").mkfifo(runs / "fifo" / "run.json")  # read without blocking: refused
    listed = write_run(runs, "list", started=900.0)
    (listed / "run.json").write_text(json.dumps({"started": 900.0, "config": ["x"]}))
    assert [r.run_dir for r in previous_runs(runs, SCRIPT)] == [real]


def test_resume_with_a_run_dir_needs_a_run_there(tmp_path: Path):
    with pytest.raises(ConfigError, match="holds no run to continue"):
        rerun.require_run(tmp_path)
    write_run(tmp_path, "r", started=1.0)
    rerun.require_run(tmp_path / "r")


# ----------------------------------------------------------------------------- the command line


def words(line: str) -> list[str]:
    """The arguments after the program in a printed resume command."""
    prefix = f"{shlex.quote(sys.executable)} -m epochal "
    assert line.startswith(prefix), line
    return shlex.split(line[len(prefix) :])


@pytest.mark.parametrize(
    ("argv", "tail", "expected"),
    [
        (
            ["run", "--nproc", "2", "train.py", "--lr", "0.1"],
            3,
            ["run", "--resume", "--run-dir", "runs/abc", "--nproc", "2", "train.py", "--lr", "0.1"],
        ),
        (  # the logging options before the command stay there; --fresh would start over
            ["--log-level", "debug", "run", "--fresh", "--nproc", "2", "t.py"],
            1,
            ["--log-level", "debug", "run", "--resume", "--run-dir", "runs/abc", "--nproc", "2",
             "t.py"],
        ),
        (  # another --run-dir (either spelling) gives way; the script's own --fresh stays
            ["run", "--run-dir=x", "--resume", "--run-dir", "y", "--nproc", "1", "t.py", "--fresh"],
            2,
            ["run", "--resume", "--run-dir", "runs/abc", "--nproc", "1", "t.py", "--fresh"],
        ),
        (
            ["coordinator", "--world-size", "4", "--bind", "tcp://0.0.0.0:29400"],
            0,
            ["coordinator", "--resume", "--run-dir", "runs/abc", "--world-size", "4", "--bind",
             "tcp://0.0.0.0:29400"],
        ),
        (
            ["run", "--nproc", "2", "-m", "pkg.train", "--data", "my dir"],
            3,
            ["run", "--resume", "--run-dir", "runs/abc", "--nproc", "2", "-m", "pkg.train",
             "--data", "my dir"],
        ),
    ],
)  # fmt: skip
def test_the_resume_command_is_the_command_given_pinned_to_its_run(argv, tail, expected):
    line = resume_command(argv, Path("runs/abc"), tail=tail)
    assert words(line) == expected
    # and it reads back as the run it continues
    args = build_parser().parse_args(expected)
    assert (args.resume, args.fresh, str(args.run_dir)) == (True, False, "runs/abc")
