"""Finding a run and continuing it, for real: the run directory is said at the start, an
interrupted or failed run ends with the command that resumes it, ``--resume`` finds the run
without ``--run-dir``, and a finished run is trained further when given more ``--epochs``.

Each continued run is compared with the uninterrupted one exactly (``torch.equal``), as in
test_resume.py: the same command, resumed, is the same training.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import (
    LISTENING,
    RESUMABLE_DEADLINE,
    RESUMABLE_EPOCHS,
    Spawner,
    assert_same_result,
    epoch_records,
    resumable_run,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DEADLINE = RESUMABLE_DEADLINE
STARTED = re.compile(
    r"\[epochal\] run (\w+), attempt 1, in (runs/\w+), coordinator at \S+; starting 2 workers"
)
"""The launcher's first line: the run directory, under the directory it runs in."""

RESUME = "to resume: "


def resume_words(line: str) -> list[str]:
    """The command a ``to resume:`` line gives, after the program (this Python's ``-m
    epochal``, as the tests start it)."""
    assert RESUME in line, line
    words = shlex.split(line.split(RESUME, 1)[1])
    assert words[:3] == [sys.executable, "-m", "epochal"], words
    return words[3:]


@pytest.mark.xdist_group("resume-reference")  # one test process, one reference run
def test_ctrl_c_says_where_the_run_is_and_the_command_that_resumes_it(spawn: Spawner, reference):
    out = spawn.tmp / "out"
    proc = resumable_run(spawn, out, delay=0.02)  # no --run-dir: runs/RUN_ID, here
    assert proc.stdout is not None
    first = proc.stdout.readline()
    started = STARTED.fullmatch(first.rstrip("\n"))
    assert started, first
    run_id, run_dir = started[1], spawn.tmp / started[2]
    wait_until(
        lambda: any(r["kind"] == "checkpoint" for r in epoch_records(run_dir)),
        60,
        "no checkpoint journaled",
    )
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    code, rest = spawn.finish(proc, DEADLINE)
    assert code == 128 + signal.SIGINT, rest
    decided = [r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    assert max(decided) < RESUMABLE_EPOCHS - 1, "the run finished before the interrupt"
    last = rest.splitlines()[-1]
    assert last.startswith(f"[epochal] {RESUME}"), rest
    words = resume_words(last)
    assert words[:4] == ["run", "--resume", "--run-dir", started[2]], words

    proc = spawn.start("-m", "epochal", *words)  # the line, as given
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert f"resuming {started[2]} at epoch" in output
    # the same run, its second attempt: one id in the first line, the journal and the result
    assert f"run {run_id}, attempt 2, in {started[2]}, coordinator at" in output
    assert_same_result(reference, out)
    assert [p.name for p in (spawn.tmp / "runs").iterdir()] == [run_id]  # no second run
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["run_id"], result["attempt"]) == (run_id, 2)
    attempts = [r["attempt"] for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    assert attempts[0] == 1 and attempts[-1] == 2 and attempts == sorted(attempts), attempts
    spawn.assert_none_left()


@pytest.mark.xdist_group("resume-reference")  # one test process, one reference run
def test_resume_continues_a_failed_run_without_its_directory(spawn: Spawner, reference):
    out = spawn.tmp / "out"
    fault = "raise@train-step:rank=1:epoch=2:step=2"
    code, output = spawn.finish(resumable_run(spawn, out, EPOCHAL_FAULT=fault), DEADLINE)
    assert code == 1, output
    lines = output.splitlines()
    assert lines[-2].startswith("[epochal] FAILED: the run was aborted"), output
    run_dir = resume_words(lines[-1])[3]
    assert run_dir.startswith("runs/")

    proc = resumable_run(spawn, out, "--resume")  # the same command, and --resume
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert f"resuming {run_dir} at epoch 2 from the checkpoint of epoch 1" in output
    assert_same_result(reference, out)
    spawn.assert_none_left()


def test_a_finished_run_is_trained_further_when_given_more_epochs(
    spawn: Spawner, tmp_path: Path, reference
):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    first = RESUMABLE_EPOCHS - 2
    proc = resumable_run(spawn, out, "--run-dir", str(run_dir), "--epochs", str(first))
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert json.loads((run_dir / "result.json").read_text())["epochs_run"] == first

    proc = resumable_run(spawn, out, "--run-dir", str(run_dir))  # RESUMABLE_EPOCHS
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert (
        f"training the run in {run_dir} further: {first} epochs before, {RESUMABLE_EPOCHS} now"
    ) in output
    assert f"resuming {run_dir} at epoch {first} from the checkpoint of epoch {first - 1}" in output
    # as if it had been started with the larger count: the same curve, the same weights
    assert_same_result(reference, out)
    decided = [r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    assert decided == list(range(RESUMABLE_EPOCHS))
    extended = {
        "from_epochs": first,
        "to_epochs": RESUMABLE_EPOCHS,
        "at_epoch": first,
        "had_finished": True,
    }
    assert json.loads((run_dir / "run.json").read_text())["extended"] == [extended]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["epochs_run"]) == ("finished", RESUMABLE_EPOCHS)
    assert result["extended"] == [extended]

    proc = resumable_run(spawn, out, "--run-dir", str(run_dir), "--epochs", str(first))
    code, output = spawn.finish(proc, 30)
    assert code == 2, output
    assert (
        f"--epochs is {first} now but {RESUMABLE_EPOCHS} in the run (a run may be given more, "
        "never fewer)"
    ) in output
    assert "starting 2 workers" not in output
    spawn.assert_none_left()


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (its SigCgt mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def coordinator_lines(spawn: Spawner, *args: str) -> tuple[int, list[str]]:
    """``epochal coordinator --world-size 2 ARGS`` waiting for workers that never come: its
    status and lines (stdout and stderr) once the rendezvous timed out."""
    proc = spawn.epochal("coordinator", "--world-size", "2", "--rendezvous-timeout", "1", *args)
    code, output = spawn.finish(proc, 60)
    return code, output.splitlines()


def test_a_coordinator_says_its_run_directory_and_how_to_resume_it(spawn: Spawner):
    proc = spawn.epochal("coordinator", "--world-size", "2", "--epochs", "3")
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith(LISTENING)
    said = proc.stdout.readline()
    where = re.fullmatch(r"epochal: run (\w+), attempt 1, in (runs/\w+)\n", said)
    assert where, said
    # serving: a stop is an abort
    wait_until(lambda: catches(proc.pid, signal.SIGTERM), 30, "SIGTERM never caught")
    os.killpg(proc.pid, signal.SIGTERM)
    code, rest = spawn.finish(proc, 30)
    assert code == 128 + signal.SIGTERM, rest
    words = resume_words(rest.splitlines()[-1])
    pinned = ["coordinator", "--resume", "--run-dir", where[2]]
    assert words == [*pinned, "--world-size", "2", "--epochs", "3"]

    # --resume without --run-dir finds that run (the same command: a coordinator's)
    code, lines = coordinator_lines(spawn, "--epochs", "3", "--resume")
    assert code == 1, lines
    assert lines[1] == f"epochal: run {where[1]}, attempt 2, in {where[2]}", lines
    assert resume_words(lines[-1])[3] == where[2]

    # a new run says there is one to continue
    code, lines = coordinator_lines(spawn, "--epochs", "3")
    assert code == 1, lines
    assert any(
        line.startswith(f"epochal: {where[2]} holds an unfinished run of this command, which ")
        and "--resume continues; starting a new one in runs/" in line
        for line in lines
    ), lines
    spawn.assert_none_left()
