"""A rank stuck in its own code while no collective runs is ended by --stall-abort, and named."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import SCRIPTS, Spawner

pytestmark = pytest.mark.slow

STALL_ABORT = 30.0
"""No rank makes progress while the ranks start and connect their data plane either (the stall
clock runs from the phase's start): on a loaded machine that took 10-18 s, and a shorter
--stall-abort ended the start instead of the hang."""
DEADLINE = 120.0


def test_a_hang_in_the_validation_loader_is_aborted_naming_the_rank(spawn: Spawner, tmp_path):
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
        str(STALL_ABORT),
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "linear.py"),
        "--mode",
        "hang-valid",  # rank 1's validation loader never yields; rank 0 reports and waits
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output
    assert "rank 1 made no progress for" in output, output
    assert "in validate of epoch 0" in output
    assert "linear.py" in output and "in __iter__" in output  # where it is stuck
    assert f"--stall-abort {STALL_ABORT:g}" in output
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
    spawn.assert_none_left()


def test_a_hang_in_the_training_loop_is_aborted_naming_the_hung_rank(spawn: Spawner, tmp_path):
    # ranks 0 and 1 wait in DDP's all-reduce for rank 2, which hangs before its step: long before
    # the collective timeout (600 s), the run ends naming rank 2, not a waiting rank
    proc = spawn.epochal(
        "run",
        "--nproc",
        "3",
        "--epochs",
        "3",
        "--stall-abort",
        str(STALL_ABORT),
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
        EPOCHAL_FAULT="hang@train-step:rank=2:epoch=1:step=3",
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output
    assert "rank 2 made no progress for" in output, output
    assert "in train of epoch 1" in output and "faults.py" in output
    spawn.assert_none_left()
