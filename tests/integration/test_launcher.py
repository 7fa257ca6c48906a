"""``epochal run`` as a user meets it: a finished run is reported finished however long the scripts
take to end, torchrun's variables are set, and a script that never joins is told why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import SCRIPTS, Spawner

pytestmark = pytest.mark.slow

DEADLINE = 120.0
"""Generous: the runs below have nothing that times out; only a hang should reach it."""

AFTER = 5.0
"""Seconds of work the script does after epochal.train() returns (more than the old 3-s kill)."""


def test_work_after_training_finishes_and_torchrun_variables_are_set(
    spawn: Spawner, tmp_path: Path
):
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "torchrun_style.py"),
        "--after",
        str(AFTER),
    )
    code, output = spawn.finish(proc, DEADLINE + AFTER)
    spawn.assert_none_left()
    assert code == 0, output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"
    for rank in (0, 1):
        assert (
            f"[rank {rank}] torchrun variables: RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 "
            "LOCAL_WORLD_SIZE=2" in output
        ), output
        assert f"[rank {rank}] rank {rank}: post-training work done" in output, output
    assert "FAILED" not in output and "killed" not in output, output
    assert "done: best epoch" in output


def test_exit_timeout_bounds_the_wait_after_a_finish(spawn: Spawner, tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--exit-timeout",
        "1",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "torchrun_style.py"),
        "--after",
        "600",
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 1, output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"
    assert "the run finished (result.json says so), but workers 0, 1 were still running 1 s " in (
        output
    )
    assert "done:" not in output


def test_a_script_that_never_calls_epochal_is_told_so(spawn: Spawner, tmp_path: Path):
    script = tmp_path / "forgot.py"
    script.write_text("def main():\n    print('training...')\n")
    proc = spawn.epochal("run", "--nproc", "2", "--run-dir", str(tmp_path / "run"), str(script))
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 1, output
    assert "exited with status 0 before the run finished" in output
    assert "did the script call epochal.train() or epochal.join()?" in output
