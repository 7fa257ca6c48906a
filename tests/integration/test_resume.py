"""Resume, for real: kill a run at several points, start it again, get the uninterrupted weights.

Every comparison is exact (``torch.equal``): CPU, gloo, the same seed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from epochal.observe.plot import restart_marks
from tests.integration.conftest import (
    RESUMABLE_DEADLINE,
    RESUMABLE_EPOCHS,
    RESUMABLE_POLICY,
    SCRIPTS,
    Spawner,
    assert_same_result,
    epoch_records,
    marked_pids,
    resumable_run,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

EPOCHS = RESUMABLE_EPOCHS
DEADLINE = RESUMABLE_DEADLINE
POLICY = RESUMABLE_POLICY


def launch(
    spawn: Spawner,
    run_dir: Path,
    out: Path,
    *extra: str,
    delay: float = 0.0,
    script: tuple[str, ...] = (),
    **env: str,
):
    return resumable_run(
        spawn, out, "--run-dir", str(run_dir), *extra, delay=delay, script=script, **env
    )


def kill_everything(spawn: Spawner) -> None:
    """SIGKILL the launcher and every worker at once: a machine that lost power."""
    for pid in marked_pids(spawn.mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in spawn.procs:
        proc.wait(timeout=10)
    spawn.assert_none_left()


MONITORED = (
    "--monitor",
    "accuracy",
    "--monitor-mode",
    "max",
    "--lr-schedule",
    "plateau:patience=0,factor=0.5,threshold=0.01,min=0",
)


@pytest.fixture(scope="module")
def monitored(tmp_path_factory) -> Path:
    """The uninterrupted run that monitors its smoothed validation accuracy."""
    tmp = tmp_path_factory.mktemp("monitored")
    spawner = Spawner("mon-" + os.urandom(4).hex(), tmp)
    try:
        proc = launch(spawner, tmp / "run", tmp / "out", *MONITORED, script=("--accuracy",))
        code, output = spawner.finish(proc, DEADLINE)
        assert code == 0, output
    finally:
        spawner.cleanup()
    return tmp / "out"


@pytest.mark.timeout(int(3 * DEADLINE) + 60)  # the monitored run and two of its own
def test_a_run_monitoring_a_metric_resumes_bit_identical(spawn, tmp_path, monitored):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    args = (spawn, run_dir, out, *MONITORED)
    launch(*args, delay=0.02, script=("--accuracy",))
    wait_until(
        lambda: sum(r["kind"] == "checkpoint" for r in epoch_records(run_dir)) >= 2,
        60,
        "fewer than 2 checkpoints journaled",
    )
    kill_everything(spawn)
    assert max(r["epoch"] for r in epoch_records(run_dir)) < EPOCHS - 1, "finished before the kill"

    proc = launch(*args, delay=0.02, script=("--accuracy",))
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert "resuming" in output
    # the smoothed accuracy, the plateau schedule's state and the best epoch came back from the
    # journal: the curve (smoothed values and metrics included) and the weights are the same
    assert_same_result(monitored, out)
    curve = torch.load(out / "rank0.pt")["curve"]
    smoothed = [c[3] for c in curve]
    assert torch.load(out / "rank0.pt")["best_epoch"] == smoothed.index(max(smoothed))
    assert all("valid_accuracy" in c[4] for c in curve)
    spawn.assert_none_left()


@pytest.mark.xdist_group("resume-reference")  # one test process, one reference run
@pytest.mark.timeout(int(3 * DEADLINE) + 60)  # the reference run and two of its own, in DEADLINE
@pytest.mark.parametrize("after_epochs", [1, 3])
def test_killed_mid_epoch_resumes_bit_identical(spawn, tmp_path, reference, after_epochs):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    # slow steps (a sleep: the numbers do not change) so the kill lands inside an epoch
    launch(spawn, run_dir, out, delay=0.02)
    wait_until(
        lambda: sum(r["kind"] == "checkpoint" for r in epoch_records(run_dir)) >= after_epochs,
        60,
        f"fewer than {after_epochs} checkpoints journaled",
    )
    kill_everything(spawn)
    records = epoch_records(run_dir)
    assert max(r["epoch"] for r in records) < EPOCHS - 1, "the run finished before the kill"
    # rank 0 writes each checkpoint while the next epoch trains (replicated) and has it journaled
    # once the rename is durable: the kill, in a later epoch, came after the last one's write
    last = max(r["epoch"] for r in records if r["kind"] == "checkpoint")

    proc = launch(spawn, run_dir, out, delay=0.02)  # the same command line: else refused
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert f"from the checkpoint of epoch {last}" in output
    assert_same_result(reference, out)
    # the resumed run's picture: curve.png drawn at its end, with the resume marked on it
    assert (run_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [label for _, label in restart_marks(run_dir)] == ["resumed"]
    spawn.assert_none_left()


@pytest.mark.xdist_group("resume-reference")  # one test process, one reference run
@pytest.mark.timeout(int(3 * DEADLINE) + 60)  # the reference run and two of its own, in DEADLINE
def test_killed_while_committing_a_checkpoint(spawn, tmp_path, reference):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = launch(spawn, run_dir, out, EPOCHAL_FAULT="kill@checkpoint-commit:rank=0:epoch=2")
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert any(".tmp-" in name for name in leftovers), leftovers  # the half-done checkpoint
    assert "epoch-000002" not in leftovers

    proc = launch(spawn, run_dir, out)
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert "from the checkpoint of epoch 1" in output
    assert_same_result(reference, out)


@pytest.mark.xdist_group("resume-reference")  # one test process, one reference run
@pytest.mark.timeout(int(3 * DEADLINE) + 60)  # the reference run and two of its own, in DEADLINE
def committed(run_dir: Path) -> int:
    """The epoch of the last checkpoint the run's journal holds as committed."""
    return max(r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "checkpoint")


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous(spawn, tmp_path, reference):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = launch(spawn, run_dir, out, EPOCHAL_FAULT="raise@train-step:rank=1:epoch=3:step=2")
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output
    # rank 0 writes epoch 2's checkpoint while epoch 3 trains, so its commit may come after rank
    # 1's failure ended the run; epoch 1's came before epoch 2's write began. The journal says
    latest = committed(run_dir)
    assert latest in (1, 2), latest
    victim = next((run_dir / "checkpoints" / f"epoch-{latest:06d}").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-7])  # truncated, as by a failing disk

    proc = launch(spawn, run_dir, out)
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert f"the checkpoint of epoch {latest} is unusable" in output
    assert "falling back" in output
    assert f"from the checkpoint of epoch {latest - 1}" in output
    assert_same_result(reference, out)


def test_a_corrupt_best_checkpoint_is_reported_never_loaded(spawn, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    # epoch 2 is the best; the run fails in epoch 4, so the rerun resumes after epoch 3 and the
    # best weights can only come from epoch 2's checkpoint at the end
    best = ("--best-at", "2")
    fault = "raise@train-step:rank=1:epoch=4:step=2"
    # slow steps: rank 0 writes epoch 3's checkpoint while epoch 4 trains, and the failure two
    # steps in must come after that commit, or the rerun would write epoch 2's again
    proc = launch(
        spawn, run_dir, out, "--smoothing", "1.0", delay=0.1, script=best, EPOCHAL_FAULT=fault
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output
    assert committed(run_dir) == 3, "epoch 3's background write outlasted two slowed steps"
    victim = next((run_dir / "checkpoints" / "epoch-000002").glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(len(data[middle : middle + 4096]))
    victim.write_bytes(bytes(data))

    proc = launch(spawn, run_dir, out, "--smoothing", "1.0", delay=0.1, script=best)
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert "from the checkpoint of epoch 3" in output
    assert "the checkpoint of epoch 2 is unusable" in output
    assert "keeps the weights of the last epoch trained (4)" in output
    for rank in (0, 1):
        result = torch.load(out / f"rank{rank}.pt")
        assert result["best_epoch"] == 2
        assert "does not match its manifest" in result["weights_note"]
        assert [r[0] for r in result["curve"]] == list(range(EPOCHS))


def test_a_finished_run_is_not_trained_again(spawn, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    code, output = spawn.finish(launch(spawn, run_dir, out), DEADLINE)
    assert code == 0, output
    before = (run_dir / "epochs.jsonl").read_text()
    code, output = spawn.finish(launch(spawn, run_dir, out), DEADLINE)
    assert code == 0, output
    assert "already finished" in output
    assert "starting 2 workers" not in output
    assert (run_dir / "epochs.jsonl").read_text() == before


def test_other_settings_are_refused_naming_the_difference(spawn, tmp_path):
    run_dir = tmp_path / "run"
    code, output = spawn.finish(launch(spawn, run_dir, tmp_path / "out"), DEADLINE)
    assert code == 0, output
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "o2"),
    )
    code, output = spawn.finish(proc, 30)
    assert code == 2
    assert "--epochs is 3 now but 5 in the run" in output  # more would train it further
    assert "--fresh" in output


def test_other_script_arguments_are_refused_naming_them(spawn, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = launch(spawn, run_dir, out, EPOCHAL_FAULT="raise@train-step:rank=1:epoch=2:step=2")
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output
    # --best-at changes what the script computes (like --seed or --lr would): another run
    code, output = spawn.finish(launch(spawn, run_dir, out, script=("--best-at", "1")), 30)
    assert code == 2, output
    assert "the workers' command line is" in output
    assert "--best-at 1" in output and "--fresh" in output
    assert "resuming" not in output
    code, output = spawn.finish(
        launch(spawn, run_dir, out, "--fresh", script=("--best-at", "1")), DEADLINE
    )
    assert code == 0, output


def test_a_run_directory_of_another_model_is_refused(spawn, tmp_path):
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "linear.py"),
        EPOCHAL_FAULT="raise@epoch-end:rank=0:epoch=1",
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 1, output  # an unfinished run of the linear model
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 2, output  # another script: refused before any worker starts
    assert f"the run directory {run_dir} holds a run with other settings" in output
    assert "the workers' command line is" in output and "the script's SHA-256 is" in output
    assert "--fresh" in output
    spawn.assert_none_left()


def held_mid_epoch(run_dir: Path, epoch: int) -> bool:
    """Whether the run's status shows every rank training ``epoch`` (rank 0 held by its fault)."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):  # not written yet, or caught while being replaced
        return False
    ranks = status.get("ranks", [])
    return len(ranks) == 2 and all(
        r["phase"] == "train" and r["epoch"] == epoch and r["step"] >= 1 for r in ranks
    )


def service_and_workers(
    spawn: Spawner,
    args: list[str],
    out: Path,
    *,
    coordinator: dict[str, str] | None = None,
    rank0: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[str], str, list[subprocess.Popen[str]]]:
    """``epochal`` ARGS as a service on a free loopback port (with the ``coordinator``
    environment) and two ``resumable.py`` workers attached to it (rank 0 with ``rank0``): the
    service, its endpoint and the workers."""
    first = spawn.epochal(*args, "--bind", "tcp://127.0.0.1:0", **(coordinator or {}))
    line = first.stdout.readline()
    endpoint = line.split()[-1]
    assert endpoint.startswith("tcp://127.0.0.1:"), line
    workers = [
        spawn.script(
            "resumable.py",
            "--out",
            str(out),
            "--delay",
            "0.02",
            EPOCHAL_COORDINATOR=endpoint,
            EPOCHAL_RANK=str(rank),
            **((rank0 or {}) if rank == 0 else {}),
        )
        for rank in (0, 1)
    ]
    return first, endpoint, workers


HOLD_EPOCH = 2
HOLD_MS = 8000
# rank 0 sleeps this long in a step of HOLD_EPOCH (rank 1 waits for it in the step's all-reduce):
# the coordinator is killed inside that window, while both ranks are surely training. Shorter
# than heartbeat_timeout + abort_grace (17 s), after which a rank that made no progress since
# it lost the coordinator gives up.


@pytest.mark.xdist_group("resume-reference")  # one test process, one reference run
@pytest.mark.timeout(int(3 * DEADLINE) + 60)  # the reference run and two of its own, in DEADLINE
def test_a_restarted_coordinator_takes_the_running_workers_back(spawn, tmp_path, reference):
    """Killed while both ranks train an epoch: the restarted one takes them back where they are,
    from its journal, and the epoch under way is decided as if it had never stopped."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    args = ["coordinator", "--world-size", "2", *POLICY, "--run-dir", str(run_dir)]
    hold = f"delay@train-step:epoch={HOLD_EPOCH}:step=4:ms={HOLD_MS}"
    first, endpoint, workers = service_and_workers(spawn, args, out, rank0={"EPOCHAL_FAULT": hold})
    wait_until(
        lambda: held_mid_epoch(run_dir, HOLD_EPOCH), 60, f"the run never held epoch {HOLD_EPOCH}"
    )
    first.kill()
    first.wait(timeout=10)
    decided = [r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    assert max(decided) == HOLD_EPOCH - 1, decided  # killed inside the epoch held
    assert any(r["kind"] == "checkpoint" for r in epoch_records(run_dir))

    second = spawn.epochal(*args, "--bind", endpoint)
    for worker in workers:
        code, output = spawn.finish(worker, DEADLINE)
        assert code == 0, output
        assert "the restarted coordinator carries on from its journal" in output, output
        assert f"its report of epoch {HOLD_EPOCH}" in output, output
    code, output = spawn.finish(second, DEADLINE)
    assert code == 0, output
    assert f"the run carries on in epoch {HOLD_EPOCH}" in output, output
    assert "resuming" not in output, output
    assert decided_once(run_dir)
    assert_same_result(reference, out)
    spawn.assert_none_left()


def decided_once(run_dir: Path) -> bool:
    """Whether the journal decided every epoch exactly once (none redone, none missing)."""
    decided = [r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    assert decided == list(range(EPOCHS)), decided
    return True


CUT_EPOCH = 1
# the first coordinator sends the decision of this epoch to rank 0 alone, then dies


@pytest.mark.xdist_group("resume-reference")  # one test process, one reference run
@pytest.mark.timeout(int(3 * DEADLINE) + 60)  # the reference run and two of its own, in DEADLINE
def test_a_coordinator_killed_between_two_sends_of_a_decision_is_carried_on(
    spawn, tmp_path, reference
):
    """The instant a restart cannot learn from the workers alone: rank 0 got the decision and
    went on into the next epoch, where it waits in a collective for rank 1, which waits for the
    decision. The restarted coordinator answers rank 1 from its journal, rank 0 comes back with
    the next epoch trained, and no epoch is redone."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    args = ["coordinator", "--world-size", "2", *POLICY, "--run-dir", str(run_dir)]
    cut = {"EPOCHAL_COORDINATOR_FAULT": f"kill@decision:epoch={CUT_EPOCH}"}
    first, endpoint, workers = service_and_workers(spawn, args, out, coordinator=cut)
    assert first.wait(timeout=DEADLINE) == -signal.SIGKILL  # it killed itself after one send
    decided = [r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    assert decided == list(range(CUT_EPOCH + 1)), decided

    second = spawn.epochal(*args, "--bind", endpoint)
    outputs = []
    for worker in workers:
        code, output = spawn.finish(worker, DEADLINE)
        assert code == 0, output
        assert "the restarted coordinator carries on from its journal" in output, output
        outputs.append(output)
    # rank 0 had the decision and trained the next epoch; rank 1 asked again for the decision
    assert f"sent again: the commit of the checkpoint of epoch {CUT_EPOCH}" in outputs[0]
    assert f"its report of epoch {CUT_EPOCH + 1}" in outputs[0], outputs[0]
    assert f"sent again: its report of epoch {CUT_EPOCH}\n" in outputs[1], outputs[1]
    code, output = spawn.finish(second, DEADLINE)
    assert code == 0, output
    assert f"the run carries on in epoch {CUT_EPOCH + 1}" in output, output
    assert decided_once(run_dir)
    assert [r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "checkpoint"].count(
        CUT_EPOCH
    ) == 1
    assert_same_result(reference, out)
    spawn.assert_none_left()
