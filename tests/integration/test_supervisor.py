"""`epochal worker`: the supervisor restarts a failing worker command, then gives up clearly."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import BOTH_STARTS, Spawner, wait_for_record

pytestmark = pytest.mark.slow  # every test runs epochal's supervisor and its workers

FLAKY = """
import os, pathlib, sys
count = pathlib.Path(sys.argv[1])
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
assert os.environ["EPOCHAL_COORDINATOR"] == "tcp://127.0.0.1:5555"
sys.exit(0 if n >= int(sys.argv[2]) else 3)
"""


def supervise(spawn: Spawner, tmp_path: Path, failures: int, restarts: int):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    proc = spawn.epochal(
        "worker",
        "--connect",
        "tcp://127.0.0.1:5555",
        "--max-restarts",
        str(restarts),
        "--restart-delay",
        "0.05",
        "--",
        sys.executable,
        str(script),
        str(tmp_path / "count"),
        str(failures),
    )
    code, output = spawn.finish(proc, 60)
    return code, output, int((tmp_path / "count").read_text())


@BOTH_STARTS
def test_a_failing_worker_is_started_again_until_it_succeeds(spawn, tmp_path):
    code, output, runs = supervise(spawn, tmp_path, failures=2, restarts=3)
    assert code == 0, output
    assert runs == 3
    assert "the worker failed (status 3); restart 1 of 3" in output
    assert "restart 2 of 3" in output and "restart 3 of 3" not in output
    spawn.assert_none_left()


def test_restarts_used_up_end_with_the_worker_status(spawn, tmp_path):
    code, output, runs = supervise(spawn, tmp_path, failures=99, restarts=1)
    assert code == 3
    assert runs == 2
    assert "the worker failed (status 3); 1 restart used up" in output


def test_a_signal_during_the_restart_delay_ends_the_supervisor_without_a_restart(spawn, tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    proc = spawn.epochal(
        "worker",
        "--connect",
        "tcp://127.0.0.1:5555",
        "--max-restarts",
        "1",
        "--restart-delay",
        "600",  # the signal comes long before the restart would
        "--",
        sys.executable,
        str(script),
        str(tmp_path / "count"),
        "99",
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # said just before the delay begins
        if "restart 1 of 1" in line:
            break
    proc.send_signal(signal.SIGTERM)
    code, output = spawn.finish(proc, 60)
    assert code == 128 + signal.SIGTERM, output
    assert (tmp_path / "count").read_text() == "1"  # the worker was not started again
    spawn.assert_none_left()


def test_a_command_is_required(spawn):
    code, output = spawn.finish(spawn.epochal("worker", "--connect", "tcp://127.0.0.1:5555"), 30)
    assert code == 2 and "give the command to run after --" in output


# its own deadlines in turn: the reference run (120 s), the first checkpoint (60 s), the
# supervisors (120 s), the coordinator (60 s)
@pytest.mark.timeout(120 + 60 + 120 + 60 + 60)
def test_remote_workers_and_a_restarting_coordinator_recover_a_killed_worker(spawn, tmp_path):
    import os

    import torch

    from tests.integration.conftest import SCRIPTS, marked_pids

    policy = ["--epochs", "4", "--lr-schedule", "step:every=2,gamma=0.5"]
    ref = spawn.epochal(
        "run",
        "--nproc",
        "2",
        *policy,
        "--run-dir",
        str(tmp_path / "ref"),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "ref-out"),
    )
    code, output = spawn.finish(ref, 120)
    assert code == 0, output

    run_dir = tmp_path / "run"
    coordinator = spawn.epochal(
        "coordinator",
        "--world-size",
        "2",
        *policy,
        "--run-dir",
        str(run_dir),
        "--max-restarts",
        "1",
        "--heartbeat-timeout",
        "3",
    )
    endpoint = coordinator.stdout.readline().split()[-1]
    supervisors = [
        spawn.epochal(
            "worker",
            "--connect",
            endpoint,
            "--max-restarts",
            "1",
            "--",
            sys.executable,
            str(SCRIPTS / "resumable.py"),
            "--out",
            str(tmp_path / "out"),
            "--delay",
            "0.02",
            EPOCHAL_RANK=str(rank),
        )
        for rank in (0, 1)
    ]
    wait_for_record(run_dir, "checkpoint")
    victim = next(
        pid
        for pid in marked_pids(spawn.mark)
        if b"EPOCHAL_RANK=1" in Path(f"/proc/{pid}/environ").read_bytes()
        # a forked process's command line is one string of words (setproctitle), an exec'd
        # one's NUL-separated: the supervisor is "epochal worker" either way
        and b"resumable.py" in (cmd := Path(f"/proc/{pid}/cmdline").read_bytes())
        and b"epochal worker" not in cmd.replace(b"\0", b" ")
    )
    os.kill(victim, signal.SIGKILL)
    for sup in supervisors:
        code, output = spawn.finish(sup, 120)
        assert code == 0, output
    code, output = spawn.finish(coordinator, 60)
    assert code == 0, output
    assert "restart 1 of 1" in output and "resuming" in output
    for rank in (0, 1):
        a = torch.load(tmp_path / "ref-out" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "out" / f"rank{rank}.pt")
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), name
    spawn.assert_none_left()
