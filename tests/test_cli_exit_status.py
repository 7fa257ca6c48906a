"""The coordinator's exit status tells a supervisor (systemd, a batch system) what happened."""

from __future__ import annotations

from pathlib import Path

import pytest

from epochal.cli import parser as cli
from epochal.coordinator.rules.machine import RunMachine
from epochal.launch.daemon import EXIT_CRASH


def coordinator(tmp_path: Path, *extra: str) -> int:
    return cli.main(["coordinator", "--world-size", "1", "--run-dir", str(tmp_path), *extra])


def test_an_abort_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert coordinator(tmp_path, "--rendezvous-timeout", "0.2") == 1
    assert "only 0 of 1 workers joined" in capsys.readouterr().err


def test_a_crash_of_the_coordinator_itself_exits_70_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(self: RunMachine, now: float) -> None:
        raise RuntimeError("a bug in the service")

    # inside the service loop, as a real bug would be: the loop's own cleanup still runs
    monkeypatch.setattr(RunMachine, "on_tick", broken)
    assert coordinator(tmp_path) == EXIT_CRASH == 70
    err = capsys.readouterr().err
    assert "RuntimeError: a bug in the service" in err and "Traceback" in err
    assert "crashed (exit status 70)" in err and "same --run-dir" in err


def test_bad_usage_still_exits_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        coordinator(tmp_path, "--bind", "tcp://256.1.1.1:0")
    assert exit_.value.code == 2


def test_a_bad_abort_grace_is_said_before_the_run_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher bounds its workers' exit by the abort grace they inherit: a value they would
    refuse is refused once, before a coordinator or worker starts."""
    monkeypatch.setenv("EPOCHAL_ABORT_GRACE", "soon")
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('started')\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--nproc", "1", "--run-dir", str(tmp_path / "run"), str(script)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.count("EPOCHAL_ABORT_GRACE='soon' is not a number of seconds") == 1, err
    assert "starting 1 worker" not in err and "started" not in err, err
