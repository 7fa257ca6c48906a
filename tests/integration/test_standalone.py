"""A standalone coordinator process with workers started by hand, in both orders."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from epochal.errors import CoordinatorUnreachable
from tests.integration.conftest import Spawner

pytestmark = pytest.mark.slow

DEADLINE = 90.0
PREFIX = "epochal coordinator listening on "


def read_endpoint(proc) -> str:
    line = proc.stdout.readline()
    assert line.startswith(PREFIX), line
    return line[len(PREFIX) :].strip()


def test_coordinator_first_then_workers(spawn: Spawner, tmp_path: Path):
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
    endpoint = read_endpoint(coordinator)
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
    workers = [
        spawn.script("linear.py", "--out", str(tmp_path / "out"), EPOCHAL_COORDINATOR=endpoint)
        for _ in range(2)
    ]
    for w in workers:
        code, output = spawn.finish(w, DEADLINE)
        assert code == 0, output
        assert "best epoch" in output
    code, output = spawn.finish(coordinator, DEADLINE)
    assert code == 0, output
    assert "finished after 3 epochs" in output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "finished"
    spawn.assert_none_left()


def test_workers_first_then_coordinator(spawn: Spawner, tmp_path: Path):
    # an ipc endpoint is known before anyone binds it, so no port has to be guessed
    endpoint = f"ipc://{tmp_path}/coordinator.sock"
    workers = [
        spawn.script("linear.py", EPOCHAL_COORDINATOR=endpoint, EPOCHAL_CONNECT_TIMEOUT="60")
        for _ in range(2)
    ]
    coordinator = spawn.epochal(
        "coordinator",
        "--bind",
        endpoint,
        "--world-size",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert read_endpoint(coordinator) == endpoint
    for w in workers:
        code, output = spawn.finish(w, DEADLINE)
        assert code == 0, output
    code, output = spawn.finish(coordinator, DEADLINE)
    assert code == 0, output
    spawn.assert_none_left()


def test_worker_of_another_job_is_refused(spawn: Spawner, tmp_path: Path):
    coordinator = spawn.epochal(
        "coordinator",
        "--world-size",
        "1",
        "--job",
        "alpha",
        "--run-dir",
        str(tmp_path / "run"),
    )
    endpoint = read_endpoint(coordinator)
    worker = spawn.script("linear.py", EPOCHAL_COORDINATOR=endpoint, EPOCHAL_JOB="beta")
    code, output = spawn.finish(worker, DEADLINE)
    assert code == 1
    assert "JoinRefused" in output
    assert "this coordinator runs job 'alpha', the worker asked for job 'beta'" in output
    assert coordinator.poll() is None  # a stranger does not end the run
    coordinator.send_signal(signal.SIGINT)
    code, output = spawn.finish(coordinator, 30)
    assert code != 0
    assert "refused worker" in output
    spawn.assert_none_left()


def test_worker_without_coordinator_gives_up_with_a_clear_error(spawn: Spawner, tmp_path: Path):
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    worker = spawn.script("linear.py", EPOCHAL_COORDINATOR=endpoint, EPOCHAL_CONNECT_TIMEOUT="2")
    code, output = spawn.finish(worker, 30)
    assert code == CoordinatorUnreachable.exit_code, output
    assert f"CoordinatorUnreachable: no coordinator answered at {endpoint} within 2 s" in output
    spawn.assert_none_left()
