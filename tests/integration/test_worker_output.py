"""What a worker started by hand prints when the run stops: the cause on one line, no traceback.

``epochal run`` filters its workers' output itself; these workers have no launcher around them
(started directly, or under ``epochal worker``), so the worker process must say it right.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.conftest import SCRIPTS, Spawner

pytestmark = pytest.mark.slow

DEADLINE = 90.0
PREFIX = "epochal coordinator listening on "
UNEVEN = "epoch 0: rank 0 has 4, rank 1 has 3 train batches"


def start_coordinator(spawn: Spawner, tmp_path: Path) -> str:
    coordinator = spawn.epochal(
        "coordinator",
        "--bind",
        "tcp://127.0.0.1:0",
        "--world-size",
        "2",
        "--epochs",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert coordinator.stdout is not None
    line = coordinator.stdout.readline()
    assert line.startswith(PREFIX), line
    return line[len(PREFIX) :].strip()


def finish_all(spawn: Spawner, workers: list) -> list[tuple[int, str]]:
    results = [spawn.finish(w, DEADLINE) for w in workers]
    spawn.finish(spawn.procs[0], DEADLINE)  # the coordinator ends with the aborted run
    spawn.assert_none_left()
    return results


def by_hand(spawn: Spawner, tmp_path: Path, mode: str, **env: str) -> list[tuple[int, str]]:
    endpoint = start_coordinator(spawn, tmp_path)
    workers = [
        spawn.script(
            "linear.py", "--mode", mode, EPOCHAL_COORDINATOR=endpoint, EPOCHAL_RANK=str(rank), **env
        )
        for rank in (0, 1)
    ]
    return finish_all(spawn, workers)


def test_an_aborted_run_ends_each_worker_with_one_line(spawn: Spawner, tmp_path: Path):
    for code, output in by_hand(spawn, tmp_path, "uneven"):
        assert code == 1, output
        assert f"epochal: RunAborted: {UNEVEN}" in output, output
        assert output.count(UNEVEN) == 1, output
        assert "Traceback" not in output, output


def test_verbose_keeps_the_tracebacks(spawn: Spawner, tmp_path: Path):
    for code, output in by_hand(spawn, tmp_path, "uneven", EPOCHAL_VERBOSE="1"):
        assert code == 1, output
        assert output.count("Traceback (most recent call last)") == 1, output
        assert f"epochal.errors.RunAborted: {UNEVEN}" in output, output


def test_epochal_worker_verbose_gives_its_worker_the_tracebacks(spawn: Spawner, tmp_path: Path):
    endpoint = start_coordinator(spawn, tmp_path)
    supervisors = [
        spawn.epochal(
            "worker",
            "--connect",
            endpoint,
            *(["--verbose"] if rank == 1 else []),
            "--",
            sys.executable,
            str(SCRIPTS / "linear.py"),
            "--mode",
            "uneven",
            EPOCHAL_RANK=str(rank),
        )
        for rank in (0, 1)
    ]
    (quiet_code, quiet), (verbose_code, verbose) = finish_all(spawn, supervisors)
    assert quiet_code == 1 and verbose_code == 1, (quiet, verbose)
    assert f"epochal: RunAborted: {UNEVEN}" in quiet and "Traceback" not in quiet, quiet
    assert "Traceback (most recent call last)" in verbose, verbose


def test_the_users_own_exception_keeps_its_traceback_once(spawn: Spawner, tmp_path: Path):
    (_, peer), (code, output) = by_hand(spawn, tmp_path, "raise")
    assert code == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert "ValueError: boom: a deliberate failure in the loss" in output, output
    # the other rank's gloo error (or the abort, whichever reached it first) is one line
    assert "Traceback" not in peer and "epochal: " in peer, peer
