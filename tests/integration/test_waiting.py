"""A worker tells what it waits for, and a failure while connecting reaches the coordinator.

- No coordinator: the worker says at once where it waits and for how long, then gives up with
  one line and the status that ``epochal worker`` does not restart.
- A data plane that cannot connect: the coordinator's abort quotes the worker's own error, or,
  when the worker goes silent while connecting, names that phase.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from epochal.errors import CoordinatorUnreachable
from epochal.worker.control.backstop import ABORT_EXIT_CODE
from tests.integration.conftest import SCRIPTS, Spawner

pytestmark = pytest.mark.slow

CONNECT_TIMEOUT = 3.0
START_MARGIN = 60.0
"""Seconds for interpreters to start and import torch on a loaded machine."""

HEARTBEAT_TIMEOUT = 4.0
ABORT_GRACE = 2.0  # the worker's default
PREFIX = "epochal coordinator listening on "


def absent(tmp_path: Path) -> str:
    """A coordinator address nobody listens on (an ipc path: no port to guess)."""
    return f"ipc://{tmp_path}/nobody-here.sock"


def test_a_worker_without_coordinator_says_so_and_gives_up_in_one_line(
    spawn: Spawner, tmp_path: Path
):
    endpoint = absent(tmp_path)
    worker = spawn.script(
        "linear.py", EPOCHAL_COORDINATOR=endpoint, EPOCHAL_CONNECT_TIMEOUT=f"{CONNECT_TIMEOUT:g}"
    )
    code, output = spawn.finish(worker, CONNECT_TIMEOUT + START_MARGIN)
    assert code == CoordinatorUnreachable.exit_code, output
    assert (
        f"waiting for the coordinator at {endpoint}: no answer yet; retrying for up to "
        f"{CONNECT_TIMEOUT:g} s (EPOCHAL_CONNECT_TIMEOUT sets how long)"
    ) in output
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        f"epochal: CoordinatorUnreachable: no coordinator answered at {endpoint} within "
        f"{CONNECT_TIMEOUT:g} s: start it first"
    ), output
    assert "Traceback" not in output
    spawn.assert_none_left()


def test_the_supervisor_does_not_restart_a_worker_that_found_no_coordinator(
    spawn: Spawner, tmp_path: Path
):
    endpoint = absent(tmp_path)
    supervisor = spawn.epochal(
        "worker",
        "--connect",
        endpoint,
        "--max-restarts",
        "2",
        "--restart-delay",
        "0.05",
        "--",
        sys.executable,
        str(SCRIPTS / "linear.py"),
        EPOCHAL_CONNECT_TIMEOUT=f"{CONNECT_TIMEOUT:g}",
    )
    code, output = spawn.finish(supervisor, CONNECT_TIMEOUT + START_MARGIN)
    assert code == CoordinatorUnreachable.exit_code, output
    assert output.count("waiting for the coordinator at") == 1, output
    assert f"could not reach the coordinator at {endpoint}; not restarting it" in output
    assert "restart 1 of 2" not in output
    spawn.assert_none_left()


def start_pair(spawn: Spawner, tmp_path: Path, rank1_env: dict[str, str]):
    coordinator = spawn.epochal(
        "coordinator",
        "--world-size",
        "2",
        "--epochs",
        "2",
        "--heartbeat-timeout",
        f"{HEARTBEAT_TIMEOUT:g}",
        "--run-dir",
        str(tmp_path / "run"),
    )
    line = coordinator.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith(PREFIX), line
    endpoint = line[len(PREFIX) :].strip()
    workers = [
        spawn.script("linear.py", EPOCHAL_COORDINATOR=endpoint, EPOCHAL_RANK="0"),
        spawn.script("linear.py", EPOCHAL_COORDINATOR=endpoint, EPOCHAL_RANK="1", **rank1_env),
    ]
    return coordinator, workers


def test_a_data_plane_error_while_connecting_is_quoted_by_the_abort(spawn: Spawner, tmp_path: Path):
    # rank 1's gloo cannot find an interface to connect on: a real data-plane error
    coordinator, (rank0, rank1) = start_pair(
        spawn, tmp_path, {"GLOO_SOCKET_IFNAME": "no-such-interface0"}
    )
    deadline = START_MARGIN + HEARTBEAT_TIMEOUT + ABORT_GRACE
    code, output = spawn.finish(coordinator, deadline)
    assert code == 1, output
    assert "rank 1 (" in output
    assert "failed: connecting the data plane failed: RuntimeError" in output
    assert "no-such-interface0" in output
    assert "sent nothing" not in output
    code0, output0 = spawn.finish(rank0, deadline)
    # rank 0 sat in gloo's connect, waiting for rank 1: the abort reached it anyway
    assert code0 in (1, ABORT_EXIT_CODE), output0
    assert "no-such-interface0" in output0
    code1, output1 = spawn.finish(rank1, deadline)
    assert code1 != 0, output1
    spawn.assert_none_left()


def test_a_rank_silent_while_connecting_is_named_in_that_phase(spawn: Spawner, tmp_path: Path):
    # rank 1 freezes (SIGSTOP: its heartbeats stop too) just before it connects the data plane
    coordinator, (rank0, _) = start_pair(spawn, tmp_path, {"EPOCHAL_FAULT": "stop@connect:rank=1"})
    deadline = START_MARGIN + HEARTBEAT_TIMEOUT + ABORT_GRACE
    code, output = spawn.finish(coordinator, deadline)
    assert code == 1, output
    assert "rank 1 (" in output
    assert "s while connecting the data plane: it died, hung or lost its network" in output
    # rank 0 sat in gloo's connect waiting for rank 1 all that time: its heartbeats went on
    assert "rank 0 (" not in output.split("run aborted:")[-1]
    code0, output0 = spawn.finish(rank0, deadline)
    assert code0 in (1, ABORT_EXIT_CODE), output0
