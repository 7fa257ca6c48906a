"""Bad input ends the run within seconds with a message naming what differs; nothing is left."""

from __future__ import annotations

import subprocess
import sys
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
    assert_ends_with_the_fix(output, "epoch 0: rank 0 has 4, rank 1 has 3 train batches")


def assert_ends_with_the_fix(output: str, reason: str) -> None:
    """A configuration or data error ends with what to fix (the ``reason`` said once, just
    above), never with a resume command that would stop on the same error again."""
    lines = output.rstrip("\n").splitlines()
    assert lines[-1] == (
        "[epochal] to fix: the configuration or data error the reason above names (a resume "
        "would stop on it again); once it is fixed, the same command runs"
    ), output
    assert reason in lines[-3], output  # "run aborted: ...", then "FAILED: ..."
    assert "to resume" not in output, output


def test_a_data_error_is_not_restarted(spawn: Spawner, tmp_path: Path):
    # a restart resumes the same data and stops on the same error: none is spent on it
    code, output, _ = run_broken(spawn, tmp_path, "uneven", "--max-restarts", "2")
    assert code == 1, output
    assert "restart 1 of 2" not in output and "restarts used up" not in output, output
    assert_ends_with_the_fix(output, "epoch 0: rank 0 has 4, rank 1 has 3 train batches")


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
    assert_ends_with_the_fix(output, "the workers' models differ")


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
    # a crash: resuming from the last checkpoint recovers from it
    last = output.rstrip("\n").splitlines()[-1]
    assert last.startswith("[epochal] to resume: "), output
    assert "--resume --run-dir" in last and "to fix" not in output, output


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


# ----------------------------------------------------------------------------- before any work


def read_only(spawn: Spawner, directory: Path, *args: str) -> tuple[int, str]:
    """``epochal ARGS`` in a mount namespace of its own in which ``directory`` is mounted
    read-only (a read-only file system: unwritable to root too); its status and output."""
    try:
        subprocess.run(["unshare", "--mount", "true"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a mount namespace of its own (unshare, as root: as in CI)")
    mount = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]
    proc = subprocess.Popen(
        [*command, str(directory), sys.executable, "-m", "epochal", *args],
        env=spawn.env(),
        cwd=spawn.tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    spawn.procs.append(proc)
    return spawn.finish(proc, DEADLINE)


def run_linear(*options: str) -> list[str]:
    return ["run", "--nproc", "2", "--epochs", "2", *options, str(SCRIPTS / "linear.py")]


def test_an_unwritable_checkpoint_directory_is_refused_before_any_worker_starts(
    spawn: Spawner, tmp_path: Path
):
    # it was found when the first checkpoint failed, after an epoch, with a worker's traceback
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(mode=0o700)
    options = ("--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(checkpoints))
    code, output = read_only(spawn, checkpoints, *run_linear(*options))
    assert code == 2, output
    assert output.splitlines() == [
        f"epochal: error: cannot write in the checkpoint directory {checkpoints} (Read-only file "
        "system): make it writable, or pass --checkpoint-dir a directory you can write in"
    ]
    assert list(checkpoints.iterdir()) == []
    spawn.assert_none_left()


def test_a_checkpoint_directory_that_cannot_be_made_is_refused_before_any_worker_starts(
    spawn: Spawner, tmp_path: Path
):
    (tmp_path / "file").write_text("")
    wanted = tmp_path / "file" / "checkpoints"  # as /proc/ck was: no one can make it
    proc = spawn.epochal(
        *run_linear("--run-dir", str(tmp_path / "run"), "--checkpoint-dir", str(wanted))
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 2, output
    assert output.splitlines() == [
        f"epochal: error: cannot create the checkpoint directory {wanted}: Not a directory at "
        f"{wanted}; pass --checkpoint-dir a directory you can create"
    ]
    spawn.assert_none_left()


@pytest.mark.parametrize("inside", [False, True])
def test_an_unwritable_run_directory_is_refused_naming_it(
    spawn: Spawner, tmp_path: Path, inside: bool
):
    read_only_dir = tmp_path / "ro"
    read_only_dir.mkdir(mode=0o700)
    run_dir = read_only_dir / "run" if inside else read_only_dir
    code, output = read_only(spawn, read_only_dir, *run_linear("--run-dir", str(run_dir)))
    assert code == 2, output
    said = (
        f"cannot create the run directory {run_dir}: Read-only file system at {run_dir}; pass "
        "--run-dir a directory you can create"
        if inside
        else f"cannot write in the run directory {run_dir} (Read-only file system): make it "
        "writable, or pass --run-dir a directory you can write in"
    )
    assert output.splitlines() == [f"epochal: error: {said}"]


def test_a_misspelt_monitor_is_refused_when_the_workers_join_naming_the_metrics(
    spawn: Spawner, tmp_path: Path
):
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--monitor",
        "acc",
        "--monitor-mode",
        "max",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
        "--accuracy",
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output
    said = (
        "--monitor acc: the workers report no metric of that name (they report loss, accuracy): "
        "did you mean --monitor accuracy? Else add 'acc' to the training code's metrics"
    )
    assert output.count(said) == 1, output
    assert "Traceback" not in output
    # epochal.train told the coordinator its metrics' names in the hello: refused before any
    # rank trained, so no epoch ran, none was decided, there is none to resume from
    assert "epoch 0 [" not in output and "train 0." not in output, output
    journal = (run_dir / "epochs.jsonl").read_text()
    assert journal == "", journal
    assert_ends_with_the_fix(output, said)
    spawn.assert_none_left()
