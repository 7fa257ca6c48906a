"""Bad input ends the run within seconds with a message naming what differs; nothing is left."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.conftest import SCRIPTS, Spawner

pytestmark = pytest.mark.slow

DEADLINE = 60.0


def run_broken(spawn: Spawner, tmp_path: Path, mode: str, *extra: str) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        *extra,
        str(SCRIPTS / "linear.py"),
        "--mode",
        mode,
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    return code, output, time.monotonic() - started


def test_uneven_batch_counts_abort_naming_each_rank(spawn: Spawner, tmp_path: Path):
    code, output, _ = run_broken(spawn, tmp_path, "uneven")
    assert code == 1, output
    assert "epoch 0: rank 0 has 4, rank 1 has 3 train batches" in output
    assert "--batch-policy truncate" in output
    # an expected abort says its cause once, without the workers' RunAborted tracebacks
    assert output.count("rank 1 has 3 train batches") == 1, output
    assert "Traceback" not in output
    assert len(output.splitlines()) <= 8, output


def test_verbose_shows_the_workers_tracebacks(spawn: Spawner, tmp_path: Path):
    code, output, _ = run_broken(spawn, tmp_path, "uneven", "--verbose")
    assert code == 1, output
    assert "RunAborted: epoch 0: rank 0 has 4, rank 1 has 3 train batches" in output
    assert output.count("Traceback (most recent call last)") == 2, output


def test_empty_loader_is_refused(spawn: Spawner, tmp_path: Path):
    code, output, _ = run_broken(spawn, tmp_path, "empty")
    assert code == 1, output
    assert "rank 1 has an empty train loader (0 batches)" in output
    assert "FAILED" in output


def test_mismatched_model_is_refused_naming_the_parameter(spawn: Spawner, tmp_path: Path):
    code, output, _ = run_broken(spawn, tmp_path, "mismatch")
    assert code == 1, output
    assert "the workers' models differ: parameter 'weight' has shape" in output
    assert "(1, 5)" in output and "(2, 5)" in output


def test_a_failing_rank_stops_the_others(spawn: Spawner, tmp_path: Path):
    code, output, _ = run_broken(spawn, tmp_path, "raise")
    assert code == 1, output
    assert "failed: ValueError: boom: a deliberate failure in the loss" in output
    # the user's traceback once, from the rank that raised; the other rank's gloo error is hidden
    assert output.count("Traceback (most recent call last)") == 1, output
    # each line says its rank once: the launcher's prefix, not torch.distributed's beside it
    assert "[rank 1] ValueError: boom: a deliberate failure in the loss" in output, output
    assert "[rank1]:" not in output, output
    assert " 1 lines " not in output, output
    assert "Connection closed by peer" not in output.split("run aborted:")[1].split("\n", 1)[1]


def test_bad_flags_are_usage_errors(spawn: Spawner):
    proc = spawn.epochal("run", "--nproc", "2", "--smoothing", "1.5", str(SCRIPTS / "linear.py"))
    code, output = spawn.finish(proc, 30)
    assert code == 2
    assert "smoothing factor must be in (0, 1]" in output
    proc = spawn.epochal("run", "--nproc", "0", str(SCRIPTS / "linear.py"))
    code, output = spawn.finish(proc, 30)
    assert code == 2 and "--nproc: must be >= 1" in output
    proc = spawn.epochal("run", "--nproc", "1", "no/such/script.py")
    code, output = spawn.finish(proc, 30)
    assert code == 2 and "no such script: no/such/script.py" in output
