"""A worker whose coordinator went silent: blocked training code exits, progressing code goes on.

The client runs in a child process (its exit is ``os._exit``) against a ROUTER that never answers:
the coordinator vanished without a word, as behind a cut link. The child is forked from the
session's preloaded process, as ``epochal run`` forks its workers (started afresh under
``EPOCHAL_TEST_FRESH``): the bounds below run from its own clock readings, not from its start.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from epochal.worker.control.backstop import ABORT_EXIT_CODE
from tests.integration.conftest import Spawner

pytestmark = pytest.mark.slow  # each test runs a worker in a process of its own

HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.0
ABORT_GRACE = 0.5
REATTACH_TIMEOUT = 1.5
# a blocked rank waits this much longer: its peer may be saying hello to a restarted coordinator
MARGIN = 3.0  # process start and the tick that notices the silence

CHILD = """
import sys, time
from epochal.errors import CoordinatorLost
from epochal.worker.control.client import ControlClient
from epochal.protocol import Liveness
from epochal.worker.joinoptions import JoinOptions

client = ControlClient(
    sys.argv[1], b"w", JoinOptions(abort_grace={grace}, reattach_timeout={reattach}),
    liveness=Liveness(interval={interval}, timeout={timeout}),
)
client.start()
print(time.monotonic(), flush=True)  # before the watch and the last progress: no exit before
client.watch_coordinator()
client.rank = 1
client.at("train", 0)
print("training", flush=True)
if sys.argv[2] == "blocked":
    time.sleep(600)  # a collective whose peer is gone
else:
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:  # slow steps, but steps
        client.check()
        time.sleep({interval})
    try:
        client.receive(timeout=5)
    except CoordinatorLost as lost:
        print("took the loss:", lost.reason, flush=True)
        sys.exit(0)
sys.exit(3)
"""


@pytest.fixture
def silent_coordinator() -> Iterator[str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Spawner]:
    """What starts the child (its output and errors on one pipe) and kills it at teardown."""
    spawner = Spawner(uuid.uuid4().hex, tmp_path)
    yield spawner
    assert not spawner.cleanup(), "the child left processes behind"


def child(processes: Spawner, endpoint: str, *args: str) -> subprocess.Popen[str]:
    code = textwrap.dedent(CHILD).format(
        interval=HEARTBEAT_INTERVAL,
        timeout=HEARTBEAT_TIMEOUT,
        grace=ABORT_GRACE,
        reattach=REATTACH_TIMEOUT,
    )
    script = processes.tmp / "child.py"
    script.write_text(code)
    return processes.start(str(script), endpoint, *args)


def finish(proc: subprocess.Popen[str], deadline: float) -> tuple[int, str, float, float]:
    """The child's exit status, output, the seconds from training to its exit as seen from here
    (at most the true ones) and from its watch to its exit (at least the true ones)."""
    assert proc.stdout is not None
    watched = float(proc.stdout.readline())  # system-wide monotonic clock
    assert proc.stdout.readline() == "training\n"
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the worker was still running {deadline} s after training began:\n{out}")
    ended = time.monotonic()
    return proc.returncode, out, ended - started, ended - watched


def test_blocked_training_code_exits_within_heartbeat_timeout_grace_and_reattach(
    processes, silent_coordinator
):
    # not before: a peer that did not get the last decision may bring it from a restarted
    # coordinator within the re-attach timeout, and the collective goes on
    least = HEARTBEAT_TIMEOUT + ABORT_GRACE + REATTACH_TIMEOUT
    bound = least + HEARTBEAT_INTERVAL + MARGIN
    code, out, took, since_watch = finish(
        child(processes, silent_coordinator, "blocked"), bound + 10
    )
    assert code == ABORT_EXIT_CODE, out
    assert took < bound, (took, out)
    assert since_watch >= least, (since_watch, out)
    assert "rank 1: the coordinator at" in out and "cannot re-attach" in out, out
    assert len(out.strip().splitlines()) == 1, out  # one line, no traceback


def test_training_code_that_makes_progress_is_left_to_take_the_loss(processes, silent_coordinator):
    # steps go on well past the point where a blocked worker would have been ended
    keep_going = 2 * (HEARTBEAT_TIMEOUT + ABORT_GRACE + REATTACH_TIMEOUT) + 1
    code, out, _, _ = finish(
        child(processes, silent_coordinator, "progress", str(keep_going)), keep_going + 30
    )
    assert code == 0, out
    assert "took the loss" in out, out
