"""``--log-format json`` / ``--log-level``: one JSON object a line on stderr, named by the part
that wrote it, and the same setting for the workers that ``epochal run`` and ``epochal worker``
start (``EPOCHAL_LOG_FORMAT`` / ``EPOCHAL_LOG_LEVEL``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from epochal import log
from epochal.cli import parser as cli
from tests.integration.conftest import Spawner

pytestmark = pytest.mark.slow  # real coordinator, launcher and worker processes

DEADLINE = 60.0
"""Neither command below trains: each ends after its rendezvous timeout or a failing child."""

SHOW_LOG_SETTINGS = (
    "import os, sys; "
    "print('worker log settings:', os.environ['EPOCHAL_LOG_LEVEL'], "
    "os.environ['EPOCHAL_LOG_FORMAT']); sys.exit(3)"
)


def json_lines(stderr: str) -> list[dict[str, str]]:
    """Every stderr line parsed; fails on a line that is not one JSON object."""
    entries = []
    for line in stderr.splitlines():
        entry = json.loads(line)
        assert isinstance(entry, dict), line
        assert set(entry) == {"time", "level", "logger", "message"}, line
        entries.append(entry)
    assert entries, "nothing was logged"
    return entries


def epochal(spawn: Spawner, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m epochal ARGS`` with stdout and stderr kept apart."""
    return subprocess.run(
        [sys.executable, "-m", "epochal", *args],
        env=spawn.env(**env),
        cwd=spawn.tmp,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        start_new_session=True,
    )


@pytest.fixture
def restore_logging() -> Iterator[None]:
    yield
    log.configure()  # main() configured this process's loggers; leave the defaults behind


def test_the_coordinator_service_logs_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    argv = ["coordinator", "--log-format", "json", "--world-size", "1"]
    assert cli.main([*argv, "--run-dir", str(tmp_path), "--rendezvous-timeout", "0.2"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("epochal coordinator listening on tcp://127.0.0.1:")  # stdout: as is
    entries = json_lines(err)
    assert {e["logger"] for e in entries} == {"epochal.coordinator"}
    assert any("only 0 of 1 workers joined" in e["message"] for e in entries), err


def test_run_logs_json_and_its_workers_get_the_same_settings(spawn: Spawner) -> None:
    script = spawn.tmp / "never_joins.py"
    script.write_text(SHOW_LOG_SETTINGS.replace("; sys.exit(3)", ""))
    proc = epochal(
        spawn,
        "run",
        "--log-format",
        "json",
        "--log-level",
        "debug",
        "--nproc",
        "1",
        "--run-dir",
        str(spawn.tmp / "run"),
        str(script),
    )
    assert proc.returncode == 1, proc.stderr
    assert "[rank 0] worker log settings: debug json" in proc.stdout.splitlines()
    entries = json_lines(proc.stderr)
    assert {e["logger"] for e in entries} == {"epochal.launcher", "epochal.coordinator"}
    assert all(e["message"].startswith("[epochal] ") for e in entries)
    failed, last = entries[-2:]  # the failure, then the command that resumes the run
    assert (failed["logger"], failed["level"]) == ("epochal.launcher", "error")
    assert failed["message"].startswith("[epochal] FAILED: the run was aborted")
    assert (last["logger"], last["level"]) == ("epochal.launcher", "warning")
    assert last["message"].startswith("[epochal] to resume: ")
    assert "epochal run --resume --run-dir " in last["message"]
    assert any(
        e["logger"] == "epochal.coordinator"
        and "did the script call epochal.train()" in e["message"]
        for e in entries
    ), proc.stderr
    spawn.assert_none_left()


def test_worker_logs_json_given_before_the_command_and_passes_it_on(spawn: Spawner) -> None:
    proc = epochal(
        spawn,
        "--log-format",
        "json",
        "worker",
        "--connect",
        "tcp://127.0.0.1:5555",
        "--max-restarts",
        "1",
        "--restart-delay",
        "0.05",
        "--",
        sys.executable,
        "-c",
        SHOW_LOG_SETTINGS,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["worker log settings: info json"] * 2
    assert [(e["logger"], e["level"], e["message"]) for e in json_lines(proc.stderr)] == [
        (
            "epochal.launcher",
            "warning",
            "epochal worker: the worker failed (status 3); restart 1 of 1",
        ),
        (
            "epochal.launcher",
            "error",
            "epochal worker: the worker failed (status 3); 1 restart used up",
        ),
    ]
    spawn.assert_none_left()


def test_log_level_hides_what_is_less_severe(spawn: Spawner) -> None:
    proc = epochal(
        spawn,
        "worker",
        "--log-level",
        "error",
        "--connect",
        "tcp://127.0.0.1:5555",
        "--max-restarts",
        "1",
        "--restart-delay",
        "0.05",
        "--",
        sys.executable,
        "-c",
        SHOW_LOG_SETTINGS,
    )
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["worker log settings: error text"] * 2
    assert proc.stderr == "epochal worker: the worker failed (status 3); 1 restart used up\n"


def test_an_unknown_level_in_the_environment_is_bad_usage(spawn: Spawner) -> None:
    command = ("--", sys.executable, "-c", "pass")
    proc = epochal(
        spawn, "worker", "--connect", "tcp://127.0.0.1:5555", *command, EPOCHAL_LOG_LEVEL="loud"
    )
    assert proc.returncode == 2
    assert "EPOCHAL_LOG_LEVEL" in proc.stderr and "debug, info, warning, error" in proc.stderr
