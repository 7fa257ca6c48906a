"""deploy/slurm/epochal.sbatch on a real (private, two-node) Slurm cluster.

The batch script is submitted exactly as the deploy README says, from the directory holding the
training script; the job must end COMPLETED with exit code 0:0 and the result in its output, and a
job requeued in the middle of its run must resume from its checkpoint and finish.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.slurm_cluster import KILL_WAIT, SlurmCluster, missing_programs, slurm_cluster
from tests.integration.conftest import MARK, marked_pids

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "epochal.sbatch"

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}

JOB_DEADLINE = 400.0
"""Upper bound on one job's life here, including a requeue; a hang fails after it, with logs."""

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,  # trains the digits example on two workers
    # every test in one test process: one cluster (module-scoped) serves them
    pytest.mark.xdist_group("slurm"),
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        os.geteuid() != 0, reason="the private Slurm cluster runs its daemons as root"
    ),
    pytest.mark.skipif(
        bool(missing_programs()),
        reason=f"missing {', '.join(missing_programs())}: apt-get install slurm-wlm munge",
    ),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPOCHAL_", "SLURM_"))}
    env.update(
        {
            MARK: mark,
            "PYTHONPATH": str(REPO),
            "EPOCHAL_PYTHON": sys.executable,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
    )
    try:
        with slurm_cluster(env) as running:
            yield running
    finally:
        # a job's processes may still be on their way out (Slurm escalates to SIGKILL after
        # KillWait); what is left after that has leaked
        deadline = time.monotonic() + KILL_WAIT + 5
        while marked_pids(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = {pid: _cmdline(pid) for pid in marked_pids(mark)}
        for pid in leftovers:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        assert not leftovers, f"processes outlived the cluster: {leftovers}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def submit(cluster: SlurmCluster, workdir: Path, coordinator_args: str, *script_args: str) -> str:
    """``sbatch --nodes=2 --ntasks-per-node=1 epochal.sbatch digits.py`` from ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "examples" / "digits.py", workdir / "digits.py")
    env = {**cluster.env, "EPOCHAL_COORDINATOR_ARGS": coordinator_args}

    done = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--ntasks-per-node=1",
            str(SBATCH),
            "digits.py",
            *script_args,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def output(workdir: Path, job_id: str) -> str:
    path = workdir / f"epochal-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


REVOKE_GRANULARITY = 1.0
"""Seconds: slurmd revokes a requeued job's credential by time stamp in whole seconds, and a new
credential stamped in the same second as the revocation is refused ("Job credential revoked")."""


def release_requeued(cluster: SlurmCluster, job: str, deadline: float, requeued_at: float) -> None:
    """Start a requeued job now rather than after Slurm's hold (BeginTime = requeue + ~2 min).

    Slurm holds a requeued batch job for about two minutes so its nodes can finish cleaning up;
    released earlier, while a node still holds the old batch step, its launch fails, and so does
    a launch in the same second as the requeue (``requeued_at``, wall clock). So: wait until the
    job is pending on its begin time, both nodes are idle and the requeue's second has passed,
    then set its start time.
    """
    while True:
        info = cluster.job(job)
        if info["JobState"] == "RUNNING" or info["JobState"] in ENDED:
            return
        nodes = cluster.node_states().values()
        settled = time.time() > int(requeued_at) + 2 * REVOKE_GRANULARITY
        if (
            settled
            and info.get("Reason") == "BeginTime"
            and all(s.rstrip("*") == "idle" for s in nodes)
        ):
            cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            return
        assert time.monotonic() < deadline, f"requeued job never became startable: {info}"
        time.sleep(0.2)


def test_digits_on_two_nodes_completes_with_the_result(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    started = time.monotonic()
    job = submit(cluster, tmp_path, "--epochs 4 --run-dir runs/digits")
    info = cluster.wait_job(job, ENDED, JOB_DEADLINE)
    out = output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{out}\n{cluster.logs()}"
    assert info["ExitCode"] == "0:0", out
    assert info["NodeList"] == "n[1-2]", info  # one worker per node, on both nodes
    # every epoch line, the workers' output labelled by Slurm task (= rank), then the result
    for epoch in range(4):
        assert re.search(rf"epoch {epoch} \[{epoch + 1}/4\]", out), out
    assert re.search(r"^0: best epoch \d of 4: .* test accuracy 0\.\d+$", out, re.M), out
    lines = out.strip().splitlines()
    assert lines[-1] == "[epochal.sbatch] exit status 0", out
    assert '"status": "finished"' in lines[-2], out
    result = json.loads((tmp_path / "runs" / "digits" / "result.json").read_text())
    assert result["status"] == "finished" and result["epochs_run"] == 4
    # the keys the job generated stay private to its owner
    state = tmp_path / ".epochal-slurm" / job
    assert (state.stat().st_mode & 0o777) == 0o700
    assert ((state / "keys").stat().st_mode & 0o777) == 0o700
    print(f"slurm job {job}: {time.monotonic() - started:.1f} s from submit to COMPLETED")


def test_a_failing_run_fails_the_job_with_its_status(cluster: SlurmCluster, tmp_path: Path) -> None:
    started = time.monotonic()
    job = submit(cluster, tmp_path, "--epochs 4", "--no-such-option")  # workers exit 2
    info = cluster.wait_job(job, ENDED, JOB_DEADLINE)
    out = output(tmp_path, job)
    assert info["JobState"] == "FAILED", f"{info}\n{out}"
    assert info["ExitCode"] == "1:0", out
    assert "unrecognized arguments: --no-such-option" in out, out
    assert out.strip().splitlines()[-1] == "[epochal.sbatch] exit status 1", out
    print(f"slurm failing job {job}: {time.monotonic() - started:.1f} s from submit to FAILED")


def test_a_requeued_job_resumes_from_its_checkpoint(cluster: SlurmCluster, tmp_path: Path) -> None:
    started = time.monotonic()
    # epochs enough to be caught in the middle, cheap ones (few steps each): the requeued job
    # trains all that are left
    epochs = 100
    job = submit(cluster, tmp_path, f"--epochs {epochs}", "--batch-size", "256")
    journal = tmp_path / "epochal-runs" / job / "epochs.jsonl"
    checkpoints = tmp_path / "epochal-runs" / job / "checkpoints"

    def checkpointed() -> int:
        if not journal.exists():
            return 0
        return sum('"kind": "checkpoint"' in line for line in journal.read_text().splitlines())

    # kill it mid-run, once a few epochs are checkpointed
    deadline = time.monotonic() + JOB_DEADLINE
    while checkpointed() < 3:
        assert cluster.job(job)["JobState"] in {"PENDING", "RUNNING"}, output(tmp_path, job)
        assert time.monotonic() < deadline, output(tmp_path, job)
        time.sleep(0.2)
    assert any(checkpoints.iterdir()), "the journal names checkpoints the directory lacks"
    requeued_at = time.time()
    cluster.run("scontrol", "requeue", job)
    requeued = time.monotonic()
    release_requeued(cluster, job, deadline=requeued + JOB_DEADLINE, requeued_at=requeued_at)

    info = cluster.wait_job(job, ENDED, JOB_DEADLINE + KILL_WAIT)
    out = output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{out}\n{cluster.logs()}"
    assert info["ExitCode"] == "0:0", out
    assert info["Restarts"] == "1", info
    resumed = re.search(r"resuming \S+ at epoch (\d+) from the checkpoint of epoch (\d+)", out)
    assert resumed, out
    assert int(resumed.group(1)) > 0, out
    result = json.loads((tmp_path / "epochal-runs" / job / "result.json").read_text())
    assert result["status"] == "finished" and result["epochs_run"] == epochs
    # both runs wrote one journal: every epoch is in it, the ones before the resume point once
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    numbers = [e["epoch"] for e in entries if e.get("kind") == "epoch"]
    assert sorted(set(numbers)) == list(range(epochs)), numbers
    assert all(numbers.count(n) == 1 for n in range(int(resumed.group(2)) + 1)), numbers
    print(
        f"slurm requeue job {job}: {requeued - started:.1f} s to requeue, "
        f"{time.monotonic() - requeued:.1f} s from requeue to COMPLETED"
    )
