"""A hostile local process against a real run, and a coordinator that stops for a while.

The attacker knows what run.json says (the run id, the endpoint) but holds no token and no session:
it takes the workers' routing identities, forges their messages, joins under a worker's id, offers
a foreign model. The run must finish as if it were not there. A coordinator stopped (SIGSTOP)
for longer than its heartbeat timeout must, once continued, blame no rank for its own silence.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import stat
import threading
import time
import types
from pathlib import Path
from types import ModuleType

import pytest
import zmq

from epochal.protocol import (
    Failed,
    Fingerprint,
    Hello,
    StoreReady,
    decode,
    encode,
)
from tests.integration.conftest import (
    SCRIPTS,
    Spawner,
    epoch_records,
    standalone_run,
    wait_for_record,
)
from tests.security.crowd import zmtp_dealer

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

DEADLINE = 120.0
POLICY = ["--epochs", "4", "--lr-schedule", "step:every=2,gamma=0.5"]
TEARDOWN = 4.0
"""Seconds a process takes from its decision to leave to its last words on a loaded machine."""
INTERPRETER_EXIT = 5.0
"""Seconds a worker's interpreter takes to exit after that (torch's teardown, under load)."""


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
    wait_for_record(run_dir, "epoch", alive=launcher)
    info = json.loads((run_dir / "run.json").read_text())
    run_id, endpoint = info["run_id"], info["endpoint"]

    fp = Fingerprint(digest="f" * 64, torch_version="x", entries=1)
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


def decided_at(run_dir: Path) -> list[float]:
    """When each epoch decided so far was journaled (wall clock)."""
    return [r["time"] for r in epoch_records(run_dir) if r.get("kind") == "epoch"]


def wait_for_epochs(run_dir: Path, count: int, proc, deadline: float) -> list[float]:
    end = time.monotonic() + deadline
    while len(times := decided_at(run_dir)) < count:
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < end, f"{len(times)} of {count} epochs within {deadline} s"
        time.sleep(0.05)
    return times


EPOCHS_MEASURED = 10
"""Epochs in each window whose pace is compared: undisturbed, then from the flood on."""

FLOOD_RATE = 8 * 1024 * 1024
"""Bytes a second the flood sends: twice what the strangers' byte budget once let in."""


def bench(name: str) -> ModuleType:
    """``bench/NAME.py``, loaded as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hostile_hellos() -> list[bytes]:
    """Frames without the token, each as large as a frame may be: the largest well-formed hello,
    hellos whose unknown trailing field is as dense as msgpack allows, and one whose strings are
    at their longest (bench/codec.py's hostile frames)."""
    dense = bench("codec").hostile()
    return [dense[name] for name in ("largest hello", "nested empty lists", "dense nil")] + [
        dense["longest strings"]
    ]


def test_a_flood_of_hostile_hellos_without_the_token_keeps_the_epochs_pace(
    spawn: Spawner, tmp_path: Path
):
    """Hellos without the token at 8 MiB/s from fresh identities (the largest well-formed one,
    dense ones, the longest strings) through a real 2-worker run: the epochs keep at least half
    their undisturbed pace, measured just before in the same run (bench/flood.py measures the
    ratio: 0.95-1.0), the coordinator never stops running, and once the flood ends the next epoch
    comes as soon as an undisturbed one would: nothing was left queued."""
    run_dir = tmp_path / "run"
    launcher = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        str(3 * EPOCHS_MEASURED + 6),
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
        "--delay",
        "0.01",
    )
    wait_for_record(run_dir, "epoch", alive=launcher)
    endpoint = json.loads((run_dir / "run.json").read_text())["endpoint"]
    start = len(decided_at(run_dir))
    before = wait_for_epochs(run_dir, start + EPOCHS_MEASURED, launcher, DEADLINE)
    per_epoch = (before[-1] - before[start - 1]) / EPOCHS_MEASURED
    stop, sent = threading.Event(), types.SimpleNamespace(value=0)
    flood = bench("flood").flood  # bench/flood.py's flooder, on a thread of this process
    flooding = threading.Thread(
        target=flood, args=(endpoint, hostile_hellos(), FLOOD_RATE, stop, sent)
    )
    flood_at = time.time()
    flooding.start()
    try:
        done = len(decided_at(run_dir))
        # at half the undisturbed pace the window takes twice as long: waiting longer than that
        # cannot pass
        after = wait_for_epochs(
            run_dir, done + EPOCHS_MEASURED, launcher, 2 * EPOCHS_MEASURED * per_epoch + 1.0
        )
        disturbed = EPOCHS_MEASURED / (after[done + EPOCHS_MEASURED - 1] - flood_at)
    finally:
        stop.set()
        flooding.join()
    ended = time.time()
    # nothing queued: the next epoch takes what two undisturbed ones take, not a backlog's drain
    settled = wait_for_epochs(run_dir, len(after) + 1, launcher, 2 * per_epoch + 1.0)
    _, output = spawn.finish(launcher, DEADLINE)
    assert "finished after" in output, output
    assert "was not running" not in output, output
    assert disturbed >= 0.5 / per_epoch, (disturbed, 1 / per_epoch)
    print(
        f"epochs per second: {1 / per_epoch:.2f} undisturbed, {disturbed:.2f} under the flood; "
        f"the next after it {settled[-1] - ended:.2f} s after its end"
    )
    spawn.assert_none_left()


def closed_by_peer(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        return conn.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


CLAIMED = 16 * 1024 * 1024
"""The size each partial frame announces: the old frame limit."""


def test_frames_that_never_end_cost_the_coordinator_no_memory(spawn: Spawner, tmp_path: Path):
    """24 connections each announce a 16 MiB frame and send all of it but the last byte. The
    coordinator's socket refuses any frame over MAX_FRAME_BYTES from its header: each connection
    is closed, and the coordinator's peak memory stays where it was (it grew by 385 MiB when it
    held them)."""
    coordinator = spawn.epochal(
        "coordinator", "--world-size", "2", "--run-dir", str(tmp_path / "run")
    )
    assert coordinator.stdout is not None
    line = coordinator.stdout.readline()
    assert line.startswith("epochal coordinator listening on "), line
    endpoint = line.split()[-1]
    peak = vm_kib(coordinator.pid, "VmHWM")
    connections = [zmtp_dealer(endpoint) for _ in range(24)]
    try:
        for conn in connections:
            conn.settimeout(10)
            try:
                conn.sendall(b"\x02" + CLAIMED.to_bytes(8, "big"))
                sent = 0
                while sent < CLAIMED - 1:
                    sent += conn.send(b"\0" * min(1 << 20, CLAIMED - 1 - sent))
            except (ConnectionResetError, BrokenPipeError):
                pass  # refused from the header: nothing more is read
        assert all(closed_by_peer(conn, 10.0) for conn in connections)
        grown = vm_kib(coordinator.pid, "VmHWM") - peak
        assert grown < 32 * 1024, f"the coordinator's peak memory grew by {grown / 1024:.0f} MiB"
    finally:
        for conn in connections:
            conn.close()
    assert coordinator.poll() is None
    coordinator.terminate()
    spawn.finish(coordinator, 30)
    spawn.assert_none_left()


def test_a_coordinator_stopped_past_its_heartbeat_timeout_blames_no_rank(spawn: Spawner):
    heartbeat_timeout = 3.0
    freeze = 2 * heartbeat_timeout  # past the run's timeout: the workers re-attach meanwhile
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

    The coordinator stays stopped until both workers have left (docs/failures.md: within the
    abort grace after their heartbeat timeout and a tick), so its stall outlasts their timeout;
    once running again it aborts after the failure settle window, naming its own stall and their
    reason.
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
    # the failure settle window (0.25 s), a turn of its loop (within a second), saying it; its
    # exit after that takes what the machine's load makes it take, and only DEADLINE bounds it
    aborted_at = run.said("run aborted: ")
    assert aborted_at is not None, output
    assert aborted_at - continued < 0.25 + 1.0 + TEARDOWN
    assert code != 0, output
    assert "the coordinator itself was not running for" in output
    aborted = next(line for line in output.splitlines() if line.startswith("run aborted: "))
    assert aborted.startswith("run aborted: this coordinator was not running for "), aborted
    assert f"the coordinator at {run.endpoint} sent nothing for {heartbeat_timeout:g} s" in aborted
    assert not re.search(r"rank \d \(.*\) sent nothing", aborted), aborted
    spawn.assert_none_left()
