"""A rank stuck in its own code is ended by --stall-abort, and named.

The hang in the training loop is here; the hang in a validation loader while no collective runs
is tests/integration/test_bounds.py's test_a_stuck_rank_bound, which also holds the abort to the
guide's bound: one run of the same command proves both, where two took STALL_ABORT each."""

from __future__ import annotations

import pytest

from tests.integration.conftest import SCRIPTS, Spawner

pytestmark = pytest.mark.slow

STALL_ABORT = 30.0
"""No rank makes progress while the ranks start and connect their data plane either (the stall
clock runs from the phase's start): on a loaded machine that took 10-18 s, and a shorter
--stall-abort ended the start instead of the hang."""
DEADLINE = 120.0


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
