"""The guide's failure bounds (docs/failures.md), each checked on short configured timeouts.

Every bound is the formula the guide states, computed from the values configured here, plus
``TEARDOWN``: the time a worker takes from its decision to leave to its last words (unwinding,
leaving the process group, printing the traceback), a few seconds on a loaded 2-core machine.
The interpreter's own exit after that (torch's teardown: 2-5 s under load) is not counted where a
worker's last words can be seen; where the bound is "every process gone", it is, up to the moment
the last worker process is gone (exited, or killed by ``epochal run``). What ``epochal run`` does
after that (it writes the result, then its own interpreter exits: the guide's "+ teardown") has
only the deadline that fails a hang, since how long it takes is a matter of the machine's load.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from epochal.launch.launcher import ABORT_EXIT_TIMEOUT
from tests.integration.conftest import wait_for_record
from tests.integration.test_faults import (
    POLICY,
    SCRIPTS,
    Output,
    run_cmd,
    worker_pid,
    workers_gone,
)

HEARTBEAT_INTERVAL = 1.0  # the workers' and the coordinator's default
TICK = 0.1  # the coordinator checks its clock at least this often
ABORT_GRACE = 2.0  # the workers' default
TEARDOWN = 4.0
DEADLINE = 120.0

pytestmark = [
    pytest.mark.slow,
    # a hang guard, not a bound: the first epoch (60 s) and the waits each test makes in turn
    # (DEADLINE each); the suite's 120 s cut the killed-coordinator test off under load before
    # its own deadline could say what the workers had printed
    pytest.mark.timeout(int(60 + 2 * DEADLINE) + 60),
]
STALL_ABORT = 30.0
"""Longer than a start takes on a loaded machine, during which no rank makes progress either."""


def test_a_frozen_worker_bound(spawn, tmp_path):
    """A stopped worker is found by its silence, named, and every worker is gone within the
    bound (tests/integration/test_faults.py's faults that end a run by other means)."""
    timeout = 3.0
    proc = run_cmd(spawn, tmp_path / "run", tmp_path / "out", "--heartbeat-timeout", str(timeout))
    out = Output(proc)
    out.wait_for("epoch 0 [1/4]")
    os.kill(worker_pid(spawn, 1), signal.SIGSTOP)
    stopped = time.monotonic()
    out.wait_for("sent nothing for", deadline=DEADLINE)
    aborted = time.monotonic() - stopped
    gone = workers_gone(spawn, proc.pid, "resumable.py") - stopped
    assert proc.wait(timeout=DEADLINE) != 0
    spawn.assert_none_left()
    # docs/failures.md: the abort after heartbeat timeout + 0.1 s; every worker gone (the frozen
    # one killed by the launcher) after a further kill grace K
    assert aborted < timeout + TICK + 1.0, f"abort {aborted:.1f} s after SIGSTOP"
    assert gone < timeout + TICK + ABORT_EXIT_TIMEOUT + TEARDOWN, f"gone {gone:.1f} s after SIGSTOP"
    out.thread.join(timeout=5)
    assert "rank 1 (worker" in out.text and "sent nothing for" in out.text


@pytest.mark.parametrize("reattach", [0.0, 3.0])
def test_a_killed_coordinator_bound(spawn, tmp_path, reattach):
    coordinator = spawn.epochal(
        "coordinator", "--world-size", "2", *POLICY, "--run-dir", str(tmp_path / "run")
    )
    endpoint = coordinator.stdout.readline().split()[-1]
    workers = [
        spawn.script(
            "resumable.py",
            "--out",
            str(tmp_path / "out"),
            EPOCHAL_COORDINATOR=endpoint,
            EPOCHAL_RANK=str(r),
            EPOCHAL_REATTACH_TIMEOUT=str(reattach),
        )
        for r in range(2)
    ]
    outputs = [Output(w) for w in workers]
    wait_for_record(tmp_path / "run", "epoch")
    coordinator.kill()
    killed = time.monotonic()
    # the worker's last words: its traceback, printed once it has left the run. A coordinator
    # killed while it sent a decision may have reached one rank only: that rank goes on into the
    # checkpoint's collectives and leaves when its peer does, saying it lost that peer. So may a
    # rank that entered a step's all-reduce just before it saw the connection close, while its
    # peer took the abort at its next call into epochal. Without a re-attach window such a rank
    # was aborted too: if its peer's process takes longer than the abort grace to exit and close
    # its end of the collective (a loaded machine), the backstop ends the blocked rank first, as
    # docs/failures.md says ("leaves a blocked collective within g"), with a line of its own
    last_words = "; and then: " if reattach else "RunAborted: the connection to the coordinator"
    endings = (last_words, "this rank lost a peer of the data plane")
    if not reattach:
        endings += ("the training code did not return to epochal within",)
    for out in outputs:
        out.wait_for_any(endings, deadline=DEADLINE)
    took = time.monotonic() - killed
    assert any(last_words in out.text for out in outputs), [out.text for out in outputs]
    for w in workers:
        assert w.wait(timeout=DEADLINE) != 0
    spawn.assert_none_left()
    # docs/failures.md: noticed within 3 heartbeat intervals; without re-attach, stopped at once
    # (the worker waits for the coordinator) or within the abort grace; with a re-attach window, at
    # the end of the epoch in progress (these last well under EPOCH) plus the window
    epoch = 1.0
    if reattach == 0:
        bound = 3 * HEARTBEAT_INTERVAL + ABORT_GRACE + TEARDOWN
    else:
        bound = 3 * HEARTBEAT_INTERVAL + epoch + reattach + TEARDOWN
    assert took < bound, (
        f"{took:.1f} s from the coordinator's death to the workers leaving; they said: "
        + " | ".join(out.text[-1500:] for out in outputs)
    )


def test_a_stuck_rank_bound(spawn, tmp_path):
    """Rank 1's validation loader never yields; rank 0 reports and waits. The abort comes within
    the bound, names rank 1 and where it is stuck, and every report marks the rank the others
    wait for (tests/integration/test_stall_abort.py has the hang in the training loop)."""
    stall_abort = STALL_ABORT
    started = time.monotonic()
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--stall-timeout",
        "1",
        "--stall-abort",
        str(stall_abort),
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "linear.py"),
        "--mode",
        "hang-valid",
    )
    out = Output(proc)
    # the first report of the hang (a slow start is reported too): >= 1 s into the stall
    out.wait_for_report(lambda rows: rows.get("1", [])[2:3] == ["validate"])
    seen = time.monotonic()
    out.wait_for("made no progress for", deadline=DEADLINE)
    aborted = time.monotonic() - seen
    gone = workers_gone(spawn, proc.pid, "linear.py") - seen
    assert proc.wait(timeout=DEADLINE) == 1
    spawn.assert_none_left()
    # docs/failures.md: the abort once every rank has been idle stall-abort seconds (heartbeats
    # report progress each interval); the stuck rank leaves after the abort grace, within the
    # launcher's kill grace
    assert aborted < stall_abort + HEARTBEAT_INTERVAL + TICK, f"abort after {aborted:.1f} s"
    assert gone < stall_abort + HEARTBEAT_INTERVAL + TICK + ABORT_EXIT_TIMEOUT + TEARDOWN
    out.thread.join(timeout=10)  # the launcher has ended: its output to its end
    output = out.text
    assert "rank 1 made no progress for" in output, output
    assert "in validate of epoch 0" in output
    assert "linear.py" in output and "in __iter__" in output  # where it is stuck
    assert f"--stall-abort {stall_abort:g}" in output
    # each report marks the one rank the others wait for, as the heartbeats last placed them: on a
    # loaded machine an early report may still see rank 0 training (its heartbeat late); once
    # rank 0 has reported and waits, rank 1 is the one marked
    tables = output.split("no rank has made progress")[1:]
    assert tables, output
    waited = 0
    for table in tables:
        rows = {x.split()[0]: x for x in table.splitlines() if x[:1].isdigit()}
        marked = [rank for rank, row in rows.items() if "*" in row]
        assert len(marked) == 1, table
        if rows["0"].split()[2] == "waiting":
            waited += 1
            assert marked == ["1"], table
    assert waited, tables  # rank 0 did report, and waited for rank 1
    assert time.monotonic() - started < DEADLINE
