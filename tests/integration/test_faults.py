"""Faults for real, with 3 workers: every scenario stops everything within its bound, or recovers.

The bounds asserted here follow from the configured timeouts (the coordinator's settle window,
the workers' abort grace, the launcher's exit timeout after an abort), not from how fast this
machine happens to be; bench/faults.py measures the actual times.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from epochal.coordinator.rules.watchdog import FAILURE_SETTLE
from epochal.launch.launcher import ABORT_EXIT_TIMEOUT
from epochal.output import PEER_LOST
from epochal.protocol import HEARTBEAT_TIMEOUT
from tests.integration.conftest import (
    SCRIPTS,
    Spawner,
    StandaloneRun,
    TcpRelay,
    cmdline,
    marked_pids,
    standalone_run,
    wait_for_record,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

POLICY = ["--epochs", "4", "--lr-schedule", "step:every=2,gamma=0.5"]
DEADLINE = 120.0
KILL_SLACK = 5.0
"""Seconds to deliver SIGKILL to what is left and reap it: no computation happens in them."""
STOP_BOUND = FAILURE_SETTLE + ABORT_EXIT_TIMEOUT + KILL_SLACK
"""From a fault the launcher sees to every worker gone: the coordinator's settle window, then
the launcher waits for the workers' exit at most ABORT_EXIT_TIMEOUT before it kills them."""
WORKER_HEARTBEAT_TIMEOUT = HEARTBEAT_TIMEOUT
"""The run's default --heartbeat-timeout, which every worker takes: the longest it takes a worker
to notice a dead coordinator."""


def run_cmd(spawn: Spawner, run_dir: Path, out: Path, *extra: str, delay: float = 0.02, **env):
    return spawn.epochal(
        "run",
        "--nproc",
        "3",
        *POLICY,
        "--run-dir",
        str(run_dir),
        *extra,
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(out),
        "--delay",
        str(delay),
        **env,
    )


class Output:
    """Reads a process's output as it comes, so a test can wait for a line."""

    def __init__(self, proc) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc) -> None:
        try:
            for line in proc.stdout:
                self.lines.append(line)
        except (OSError, ValueError):  # the fixture closed the pipe at teardown
            pass

    def wait_for(self, text: str, deadline: float = 60.0) -> None:
        self.wait_for_any((text,), deadline)

    def wait_for_any(self, texts: tuple[str, ...], deadline: float = 60.0) -> None:
        """Until one of ``texts`` appears in a line of the output."""
        wait_until(
            lambda: any(text in line for line in self.lines for text in texts),
            deadline,
            lambda: f"never saw any of {texts!r}:\n{self.text}",
        )

    def stall_reports(self) -> list[dict[str, list[str]]]:
        """Every whole stall report so far: its table's rows, each split into its cells, by rank
        (rank, host, phase, epoch, step, seconds since progress, then where it is)."""
        reports = []
        for part in self.text.split("no rank has made progress for")[1:]:
            if STALL_TABLE_END not in part:
                break  # still being written
            table = part[: part.index(STALL_TABLE_END)].splitlines()
            rows = [line.split() for line in table if line[:1].isdigit()]
            reports.append({row[0]: row for row in rows})
        return reports

    def wait_for_report(
        self, found: Callable[[dict[str, list[str]]], bool] = lambda rows: True, after: int = -1
    ) -> int:
        """Until a whole stall report after the one at index ``after`` has rows that are
        ``found``; its index among the reports."""
        end = time.monotonic() + DEADLINE
        while True:
            for index, rows in enumerate(self.stall_reports()):
                if index > after and found(rows):
                    return index
            assert time.monotonic() < end, f"no such stall report:\n{self.text}"
            time.sleep(0.05)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def worker_pid(spawn: Spawner, rank: int) -> int:
    needle = f"EPOCHAL_RANK={rank}".encode()
    for pid in marked_pids(spawn.mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in env and b"resumable.py" in cmd:
            return pid
    raise AssertionError(f"no worker process of rank {rank}")


def workers_gone(spawn: Spawner, launcher: int, script: str = "resumable.py") -> float:
    """Until no process of this test but the ``launcher`` runs ``script`` (the workers; a zombie
    does not run): when they were gone."""
    wait_until(
        lambda: (
            not any(
                script.encode() in cmdline(pid)
                for pid in marked_pids(spawn.mark)
                if pid != launcher
            )
        ),
        DEADLINE,
        f"workers running {script} outlived the deadline",
    )
    return time.monotonic()


def stop_time(spawn: Spawner, proc, since: float) -> float:
    """Seconds from ``since`` until every worker of the launcher ``proc`` is gone; the launcher's
    own exit after that (the result written, its interpreter's teardown: what the machine's
    load makes it) has only DEADLINE, and must fail the run."""
    took = workers_gone(spawn, proc.pid) - since
    assert proc.wait(timeout=DEADLINE) != 0
    return took


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, once for the tests that compare with it (one xdist_group)."""
    tmp = tmp_path_factory.mktemp("reference")
    spawner = Spawner("ref3-" + os.urandom(4).hex(), tmp)
    try:
        code, output = spawner.finish(run_cmd(spawner, tmp / "run", tmp / "out", delay=0), DEADLINE)
        assert code == 0, output
    finally:
        spawner.cleanup()
    return tmp / "out"


def same_weights(a: Path, b: Path) -> None:
    for rank in range(3):
        x, y = torch.load(a / f"rank{rank}.pt"), torch.load(b / f"rank{rank}.pt")
        assert x["best_epoch"] == y["best_epoch"]
        for name in x["model"]:
            assert torch.equal(x["model"][name], y["model"][name]), name


@pytest.mark.parametrize("seed", [11, 23])
def test_sigkill_of_a_worker_stops_every_process(spawn, tmp_path, seed):
    rng = random.Random(seed)
    proc = run_cmd(spawn, tmp_path / "run", tmp_path / "out")
    out = Output(proc)
    out.wait_for("epoch 0 [1/4]")
    time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside epoch 1
    victim = rng.randrange(3)
    os.kill(worker_pid(spawn, victim), signal.SIGKILL)
    took = stop_time(spawn, proc, time.monotonic())
    spawn.assert_none_left()
    out.thread.join(timeout=5)
    assert f"worker {victim} (pid" in out.text and "was killed by SIGKILL" in out.text
    assert took < STOP_BOUND, f"{took:.1f} s from SIGKILL to every process stopped"


def test_a_peer_lost_by_the_data_plane_is_said_in_words(spawn, tmp_path):
    """Rank 1 dies inside epoch 1's training step; rank 0's gloo all-reduce fails with gloo's
    own text (source path, peer address, "GLHF!"), which stays in rank 0's output."""
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "linear.py"),
        EPOCHAL_FAULT="kill@train-step:rank=1:epoch=1:step=1",
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 1, output
    (cause,) = [line for line in output.splitlines() if "run aborted:" in line]
    assert "worker 1 (pid" in cause and "was killed by SIGKILL" in cause, output
    for raw in ("pair.cc", "gloo", "GLHF", "[127.0.0.1]:"):
        assert raw not in cause, output
    if "rank 0 (" in cause:  # its failure came within the settle window: said in words
        assert f"failed: {PEER_LOST}; the RuntimeError it raised is in this worker's output" in (
            cause
        ), output
        # and the last line, which counts the lines hidden, says that error is one of them
        assert "the RuntimeError the reason points to" in output.splitlines()[-2], output
    assert " 1 lines " not in output, output


@pytest.mark.xdist_group("faults-reference")  # one test process, one reference run
@pytest.mark.timeout(int(2 * DEADLINE) + 60)  # the reference run and its own, each in DEADLINE
def test_with_restarts_a_killed_worker_costs_nothing(spawn, tmp_path, reference):
    proc = run_cmd(spawn, tmp_path / "run", tmp_path / "out", "--max-restarts", "1")
    out = Output(proc)
    out.wait_for("epoch 1 [2/4]")
    os.kill(worker_pid(spawn, 2), signal.SIGKILL)
    assert proc.wait(timeout=DEADLINE) == 0, out.text
    out.thread.join(timeout=5)
    assert "restart 1 of 1" in out.text and "resuming" in out.text
    same_weights(reference, tmp_path / "out")
    spawn.assert_none_left()


def test_restarts_used_up_give_a_clear_final_error(spawn, tmp_path):
    proc = run_cmd(
        spawn,
        tmp_path / "run",
        tmp_path / "out",
        "--max-restarts",
        "1",
        EPOCHAL_FAULT="raise@train-step:rank=1:epoch=1:step=1",
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1
    assert "FAILED: 1 restart used up; the last failure:" in output
    assert "InjectedFault" in output
    # a failure beyond the restarts: resuming from the last checkpoint recovers from it
    assert output.rstrip("\n").splitlines()[-1].startswith("[epochal] to resume: "), output
    spawn.assert_none_left()


# A stopped worker, found by its silence: tests/integration/test_bounds.py's
# test_a_frozen_worker_bound, which also holds it to the guide's bound.


def test_a_killed_coordinator_stops_its_workers(spawn):
    run = standalone_run(spawn, *POLICY, world=3, delay=0.02, EPOCHAL_REATTACH_TIMEOUT="0")
    wait_for_record(run.run_dir, "epoch")
    run.coordinator.kill()
    killed = time.monotonic()
    outputs = []
    for w in run.workers:
        code, output = spawn.finish(w, DEADLINE)
        assert code != 0
        outputs.append(output)
    # each worker notices on its own: by the closed connection, or (a loaded machine may deliver
    # the close late) by the silence; one that notices later may first lose a peer of the data
    # plane to one that already left, and says that consequence, not another cause
    coordinator_gone = re.compile(
        r"the connection to the coordinator at \S+ closed|the coordinator at \S+ sent nothing"
    )
    named = [coordinator_gone.search(output) is not None for output in outputs]
    assert any(named), outputs
    for said, output in zip(named, outputs, strict=True):
        assert said or "this rank lost a peer of the data plane" in output, output
    # no launcher here: each worker notices, leaves within abort_grace, and shuts down
    assert time.monotonic() - killed < WORKER_HEARTBEAT_TIMEOUT + ABORT_EXIT_TIMEOUT + KILL_SLACK
    spawn.assert_none_left()


class CuttableProxy(TcpRelay):
    """A TCP relay that can stop relaying while keeping its connections open: a cut link."""


def test_a_cut_control_link_stops_everything(spawn):
    run = StandaloneRun(spawn, 3, *POLICY, "--heartbeat-timeout", "3")
    proxy = CuttableProxy(int(run.endpoint.rsplit(":", 1)[1]))
    proxy.start()
    try:
        run.start_workers(
            delay=0.02, connect={2: f"tcp://127.0.0.1:{proxy.port}"}, EPOCHAL_REATTACH_TIMEOUT="0"
        )
        wait_for_record(run.run_dir, "epoch")
        proxy.flowing.clear()
        cut = time.monotonic()
        code, output = run.finish_coordinator(DEADLINE)
        assert code == 1
        assert "rank 2 (worker" in output and "sent nothing for" in output
        for w in run.workers:
            code, _ = spawn.finish(w, DEADLINE)
            assert code != 0
        # rank 2 hears nothing either: it leaves after the run's heartbeat timeout, 3 s
        assert time.monotonic() - cut < 3 + ABORT_EXIT_TIMEOUT + KILL_SLACK
        spawn.assert_none_left()
    finally:
        proxy.close()


HANG_STEP = 3
"""The step (from 0) of epoch 1 before which rank 2 hangs; the table counts the steps begun."""
STALL_TABLE_END = "(* the rank the others wait for)"
"""The last line of a stall report's table."""


def test_a_stall_is_located_in_a_table(spawn, tmp_path):
    proc = run_cmd(
        spawn,
        tmp_path / "run",
        tmp_path / "out",
        "--stall-timeout",
        "2",
        EPOCHAL_FAULT=f"hang@train-step:rank=2:epoch=1:step={HANG_STEP}",
    )
    out = Output(proc)
    # a loaded machine may report a stall before the hang too (a slow start, a slow step): the
    # first report that sees rank 2 at the hang's step, then the whole next one, a --stall-timeout
    # later, by when every rank's heartbeat (one a second) says where it waits
    hung = out.wait_for_report(
        lambda rows: rows.get("2", [])[2:5] == ["train", "1", str(HANG_STEP + 1)]
    )
    following = out.wait_for_report(after=hung)
    table = out.stall_reports()[following]
    rows = {rank: " ".join(cells) for rank, cells in table.items()}
    assert set(rows) == {"0", "1", "2"}, table
    # the hung rank is caught in its own code; the others wait inside the framework
    assert "faults.py" in rows["2"] and "in hit" in rows["2"]
    assert "faults.py" not in rows["0"] and "faults.py" not in rows["1"]
    assert all(" train " in row for row in rows.values())
    assert "*" in rows["2"] and "*" not in rows["0"] + rows["1"]  # the rank the others wait for
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_BOUND) == 128 + signal.SIGTERM
    out.thread.join(timeout=10)
    spawn.assert_none_left()


def test_a_lost_control_message_is_named_not_waited_for(spawn, tmp_path):
    proc = run_cmd(
        spawn,
        tmp_path / "run",
        tmp_path / "out",
        EPOCHAL_FAULT="drop@send:rank=1:type=epoch_report",
    )  # rank 1's loss reports vanish
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1
    assert "rank 1 (worker" in output and "its loss report never arrived" in output
    spawn.assert_none_left()


def test_a_corrupted_control_message_aborts_naming_the_rank(spawn, tmp_path):
    proc = run_cmd(
        spawn,
        tmp_path / "run",
        tmp_path / "out",
        EPOCHAL_FAULT="corrupt@send:rank=2:type=epoch_ready",
    )  # rank 2's batch counts garbled
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1
    assert "rank 2 sent a malformed message" in output
    spawn.assert_none_left()


@pytest.mark.xdist_group("faults-reference")  # one test process, one reference run
@pytest.mark.timeout(int(2 * DEADLINE) + 60)  # the reference run and its own, each in DEADLINE
def test_with_restarts_a_frozen_worker_costs_nothing(spawn, tmp_path, reference):
    proc = run_cmd(
        spawn, tmp_path / "run", tmp_path / "out", "--max-restarts", "1", "--heartbeat-timeout", "3"
    )
    out = Output(proc)
    out.wait_for("epoch 1 [2/4]")
    os.kill(worker_pid(spawn, 0), signal.SIGSTOP)
    assert proc.wait(timeout=DEADLINE) == 0, out.text
    out.thread.join(timeout=5)
    assert "rank 0 (worker" in out.text and "sent nothing for" in out.text
    assert "restart 1 of 1" in out.text
    same_weights(reference, tmp_path / "out")
    spawn.assert_none_left()
