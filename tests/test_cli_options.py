"""Options are read as typed: never as a shortening of another, and a misspelt one is answered
with the one it most likely stands for; ``dir(epochal)`` shows the public API."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import epochal
from epochal.cli import parser as cli
from epochal.cli.parser import build_parser, main
from epochal.cli.suggest import close_matches, did_you_mean


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The last line ``epochal ARGV`` writes on stderr when it refuses its arguments (status 2)."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(q for s in subs for p in s.choices.values() for q in parsers(p))]


def test_no_parser_takes_a_shortening_of_an_option():
    found = parsers(build_parser())
    assert {p.prog for p in found} >= {
        "epochal",
        "epochal run",
        "epochal coordinator",
        "epochal worker",
        "epochal keys generate",
        "epochal status",
        "epochal plot",
    }
    assert [p.prog for p in found if p.allow_abbrev] == []


def test_a_shortened_option_is_refused_naming_the_whole_one(capsys):
    # argparse took --epoch 2 for --epochs 2, silently
    line = usage_error(capsys, "run", "--nproc", "2", "--epoch", "2", "train.py")
    assert line == "epochal run: error: unrecognized arguments: --epoch; did you mean --epochs?"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["run", "--nproc", "2", "--smothing", "0.5", "t.py"],
            "epochal run: error: unrecognized arguments: --smothing; did you mean --smoothing?",
        ),
        (
            ["coordinator", "--world-size", "2", "--heartbeat-timeuot", "5"],
            "did you mean --heartbeat-timeout?",
        ),
        (
            ["worker", "--connect", "tcp://h:1", "--max-restart", "2", "--", "python", "t.py"],
            "epochal worker: error: unrecognized arguments: --max-restart; did you mean "
            "--max-restarts?",
        ),
        (
            ["keys", "generate", "--worker", "2", "keys"],
            "epochal keys generate: error: unrecognized arguments: --worker keys; did you mean "
            "--workers?",
        ),
        (
            ["coordinator", "--world-size", "2", "--epohcs", "3", "--jbo", "x"],
            "unrecognized arguments: --epohcs 3 --jbo x; did you mean --epochs for --epohcs, "
            "--job for --jbo?",
        ),
        (["coordinator", "--world-size", "2", "--zzz"], "unrecognized arguments: --zzz"),
    ],
)
def test_a_misspelt_option_is_answered_with_the_likeliest_one(capsys, argv, said):
    assert usage_error(capsys, *argv).endswith(said)


def test_an_options_value_is_not_taken_for_a_misspelt_option(capsys):
    # the script's own options are the script's: nothing is suggested for them
    args = build_parser().parse_args(["run", "--nproc", "2", "t.py", "--epoch", "3"])
    assert args.script_args == ["--epoch", "3"] and args.epochs == 10


def test_the_suggestions_are_those_of_the_settings_file_too():
    assert close_matches("--epoch", ["--epochs", "--job", "--nproc"], n=1) == ["--epochs"]
    assert close_matches("epoch", ["epochs", "job"]) == ["epochs"]
    assert did_you_mean("acc", ["loss", "accuracy"], quote=True) == "; did you mean 'accuracy'?"
    assert did_you_mean("zzz", ["epochs"]) == ""


def test_resume_and_fresh_together_are_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["run", "--nproc", "1", "--resume", "--fresh", "t.py"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--resume continues a run and --fresh starts it over: give one of them" in err
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_dir_lists_the_lazily_imported_api():
    assert {"train", "join", "fit", "start_coordinator", "RunResult", "TrainState"} <= set(
        dir(epochal)
    )
    assert set(epochal.__all__) <= set(dir(epochal))
    # and listing it imports nothing heavy: the names come from __all__, not from torch
    code = "import sys, epochal; d = dir(epochal); print('train' in d, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_a_directory_of_runs_that_cannot_be_made_names_the_flag_to_use(
    tmp_path, capsys, monkeypatch
):
    (tmp_path / "file").write_text("")
    runs = tmp_path / "file" / "runs"  # as runs/ under a read-only working directory
    monkeypatch.setattr(cli, "DEFAULT_RUNS", runs)
    with pytest.raises(SystemExit) as exited:
        main(["coordinator", "--world-size", "1"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"epochal: error: cannot create the directory of runs {runs}: Not a directory at {runs}; "
        "pass --run-dir a directory you can create"
    )
