"""A hostile local process against a real run, and a coordinator that stops for a while.

The attacker knows what run.json says (the run id, the endpoint) but holds no token and no session:
it takes the workers' routing identities, forges their messages, joins under a worker's id, offers
a foreign model. The run must finish as if it were not there. A coordinator stopped (SIGSTOP)
for longer than its heartbeat timeout must, once continued, blame no rank for its own silence.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from pathlib import Path

import pytest
import zmq

from epochal.protocol import (
    Failed,
    Fingerprint,
    Hello,
    ParamSpec,
    StoreReady,
    decode,
    encode,
)
from tests.integration.conftest import SCRIPTS, Spawner, standalone_run

pytestmark = pytest.mark.slow

DEADLINE = 120.0
POLICY = ["--epochs", "4", "--lr-schedule", "step:every=2,gamma=0.5"]
TEARDOWN = 4.0
"""Seconds a process takes from its decision to leave to its last words on a loaded machine."""
INTERPRETER_EXIT = 5.0
"""Seconds a worker's interpreter takes to exit after that (torch's teardown, under load)."""
WORKER_HEARTBEAT_TIMEOUT = 15.0
"""The workers' own heartbeat timeout (epochal.join's default; the test scripts keep it)."""


def wait_for_first_epoch(run_dir: Path, proc) -> None:
    epochs = run_dir / "epochs.jsonl"
    deadline = time.monotonic() + 60
    while not (epochs.exists() and epochs.read_text().strip()):
        assert proc.poll() is None, "the run ended before its first epoch"
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)


def test_a_local_process_without_the_token_cannot_end_or_redirect_an_epochal_run(
    spawn: Spawner, tmp_path: Path
):
    run_dir = tmp_path / "run"
    launcher = spawn.epochal(
        "run",
        "--nproc",
        "2",
        *POLICY,
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
        "--delay",
        "0.03",
    )
    wait_for_first_epoch(run_dir, launcher)
    info = json.loads((run_dir / "run.json").read_text())
    run_id, endpoint = info["run_id"], info["endpoint"]

    fp = Fingerprint(digest="f" * 64, params=(ParamSpec("w", (3,), "float32"),), torch_version="x")
    ctx = zmq.Context()
    replies: list[object] = []
    try:
        for index, forged in ((1, Failed(reason="forged")), (0, StoreReady("6.6.6.6", 666))):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{run_id}/local-{index}".encode())
            sock.setsockopt(zmq.LINGER, 500)
            sock.connect(endpoint)
            sock.send(encode(forged))
            sock.close()
        for worker_id in (f"{run_id}/local-1", "stranger"):  # a duplicate id; a foreign model
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.connect(endpoint)
            hello = Hello("epochal", "", worker_id, "h", os.getpid(), 1, "cpu", fp)
            sock.send(encode(hello))
            replies.append(decode(sock.recv()))
            sock.close()
    finally:
        ctx.term()
    _, output = spawn.finish(launcher, DEADLINE)
    # the run's own verdict, not the exit status: that also covers the workers' exit after the
    # finish, within the launcher's few seconds of grace, which an overloaded machine can miss
    assert "finished after 4 epochs" in output, output
    assert "run aborted" not in output, output
    assert "forged" not in output.split("refused")[0]  # no rank failed with the forged reason
    assert "6.6.6.6" not in output
    assert [getattr(r, "code", None) for r in replies] == ["refused", "refused"], replies
    assert all("wrong or missing job token" in r.reason for r in replies), replies  # type: ignore[attr-defined]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished"
    assert stat.S_IMODE((run_dir / "run.json").stat().st_mode) == 0o600
    spawn.assert_none_left()


def test_a_coordinator_stopped_past_its_heartbeat_timeout_blames_no_rank(spawn: Spawner):
    heartbeat_timeout = 3.0
    freeze = 2 * heartbeat_timeout  # past the coordinator's timeout, within the workers'
    assert freeze + 2 < WORKER_HEARTBEAT_TIMEOUT
    run = standalone_run(
        spawn,
        *POLICY,
        "--heartbeat-timeout",
        str(heartbeat_timeout),
        "--heartbeat-interval",
        "0.5",
    )
    run.wait_for_first_epoch()
    os.kill(run.coordinator.pid, signal.SIGSTOP)
    try:
        time.sleep(freeze)
    finally:
        os.kill(run.coordinator.pid, signal.SIGCONT)
    for worker in run.workers:
        code, output = spawn.finish(worker, DEADLINE)
        assert code == 0, output
    code, output = run.finish_coordinator(30)
    assert code == 0, output
    assert "finished after 4 epochs" in output
    assert "the coordinator itself was not running for" in output
    assert "sent nothing for" not in output
    spawn.assert_none_left()


def test_a_coordinator_stopped_past_the_workers_heartbeat_timeout_is_waited_for(spawn: Spawner):
    """The workers give the stopped coordinator up and say hello again; once it runs, they go on.

    The coordinator answers with what it queued (the Go or Decision they waited for) or with a
    welcome carrying their session: the same coordinator, only stalled. The run finishes; nobody
    meets an "unexpected Go" and no rank is blamed.
    """
    heartbeat_timeout = 3.0  # the coordinator's and the workers' alike
    heartbeat_interval = 0.5
    reattach = 60.0
    freeze = 3 * heartbeat_timeout  # past both timeouts: every worker declares the coordinator lost
    run = standalone_run(
        spawn,
        *POLICY,
        "--heartbeat-timeout",
        str(heartbeat_timeout),
        "--heartbeat-interval",
        str(heartbeat_interval),
        worker_args=("--heartbeat-timeout", str(heartbeat_timeout)),
        EPOCHAL_REATTACH_TIMEOUT=str(reattach),
    )
    run.wait_for_first_epoch()
    os.kill(run.coordinator.pid, signal.SIGSTOP)
    try:
        time.sleep(freeze)
    finally:
        os.kill(run.coordinator.pid, signal.SIGCONT)
    outputs = []
    for worker in run.workers:
        code, output = spawn.finish(worker, DEADLINE)
        outputs.append(output)
        assert code == 0, output
        assert "unexpected" not in output, output
    assert any("sent nothing for" in o and "answered again" in o for o in outputs), outputs
    code, output = run.finish_coordinator(30)
    assert code == 0, output
    assert "finished after 4 epochs" in output
    assert "the coordinator itself was not running for" in output
    assert "said hello again" in output
    assert "sent nothing for" not in output
    spawn.assert_none_left()


def test_workers_that_may_not_reattach_to_a_stopped_coordinator_name_its_silence(spawn: Spawner):
    """With no re-attach window the workers stop; every reason names the coordinator's stall.

    The coordinator stays stopped until both workers have left (README: within the abort grace
    after their heartbeat timeout and a tick), so its stall outlasts their timeout; once running
    again it aborts after the failure settle window, naming its own stall and their reason.
    """
    heartbeat_timeout = 3.0
    # the workers' notice (timeout + their heartbeat tick), abort grace, unwinding, torch's exit
    workers_gone = heartbeat_timeout + 1.0 + 2.0 + TEARDOWN + INTERPRETER_EXIT
    run = standalone_run(
        spawn,
        *POLICY,
        "--heartbeat-timeout",
        str(heartbeat_timeout),
        "--heartbeat-interval",
        "0.5",
        worker_args=("--heartbeat-timeout", str(heartbeat_timeout)),
        EPOCHAL_REATTACH_TIMEOUT="0",
    )
    run.wait_for_first_epoch()
    os.kill(run.coordinator.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while any(w.poll() is None for w in run.workers):
            assert time.monotonic() - stopped < workers_gone, "the workers did not leave in time"
            time.sleep(0.05)
    finally:
        os.kill(run.coordinator.pid, signal.SIGCONT)
    continued = time.monotonic()
    assert continued - stopped > heartbeat_timeout
    for worker in run.workers:
        code, output = spawn.finish(worker, DEADLINE)
        assert code != 0, output
        assert f"sent nothing for {heartbeat_timeout:g} s" in output, output
        assert "unexpected" not in output, output
    code, output = run.finish_coordinator(DEADLINE)
    # the failure settle window (0.25 s), a turn of its loop (within a second), its own exit
    assert time.monotonic() - continued < 0.25 + 1.0 + TEARDOWN
    assert code != 0, output
    assert "the coordinator itself was not running for" in output
    aborted = next(line for line in output.splitlines() if line.startswith("run aborted: "))
    assert aborted.startswith("run aborted: this coordinator was not running for "), aborted
    assert f"the coordinator at {run.endpoint} sent nothing for {heartbeat_timeout:g} s" in aborted
    assert not re.search(r"rank \d \(.*\) sent nothing", aborted), aborted
    spawn.assert_none_left()
