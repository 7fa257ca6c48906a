"""Lose a worker and the others carry on: real ``epochal run --min-workers`` runs on this machine.

Four workers train ``linear.py`` (a fixed global batch of 12 rows, so every world size takes the
same steps) for three epochs with ``--min-workers 3``; a fault kills one rank once (in world 0)
at a given point of epoch 1 (or in the checkpoint of epoch 0, just before it). The survivors form
a new world of three that redoes epoch 1 from its start, restored from memory. The reference is
the same run with the rank killed before epoch 1 takes its first step: the survivors then start
epoch 1 at three with nothing to undo. A restore that left any trace of the interrupted steps
(weights, momentum, generators) would differ from it in the last bits; the test compares the
weights bit for bit, checks that the survivors are the processes that started, and that the
validation losses stay within float rounding of a run that lost no worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import BOTH_STARTS, SCRIPTS, Spawner, epoch_records, marked_pids
from tests.waiting import wait_until

DEADLINE = 240.0
"""Generous: a change of world is bounded by the settle window and the store's start; only a
hang should reach it."""

pytestmark = [
    pytest.mark.slow,
    # each run is bounded by DEADLINE; a test runs up to four in turn (the replacement and the
    # three legs of its reference), which on a loaded machine takes longer than the suite's
    # default per-test timeout
    pytest.mark.timeout(5 * DEADLINE),
]


def start_elastic(
    spawn: Spawner,
    tmp_path: Path,
    name: str,
    fault: str,
    *,
    least: int = 3,
    epochs: int = 3,
    options: tuple[str, ...] = (),
    script: tuple[str, ...] = (),
    restore_best: bool = False,
    program: str = "linear.py",
) -> tuple[subprocess.Popen[str], Path, Path]:
    """``epochal run --nproc 4 --min-workers LEAST`` of linear.py with ``fault`` set: the
    process, the run directory and where each rank saves its weights (the last epoch's, unless
    ``restore_best``)."""
    run_dir, out = tmp_path / name, tmp_path / f"{name}-out"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "4",
        "--min-workers",
        str(least),
        "--epochs",
        str(epochs),
        *(() if restore_best else ("--no-restore-best",)),
        "--run-dir",
        str(run_dir),
        *options,
        str(SCRIPTS / program),
        "--out",
        str(out),
        *script,
        EPOCHAL_FAULT=fault,
    )
    return proc, run_dir, out


def elastic_run(
    spawn: Spawner, tmp_path: Path, name: str, fault: str, **given: Any
) -> tuple[int, str, Path, Path]:
    """:func:`start_elastic`, run to its end: its exit status and output too."""
    proc, run_dir, out = start_elastic(spawn, tmp_path, name, fault, **given)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    return code, output, run_dir, out


def weights(out: Path) -> dict[int, dict[str, Any]]:
    return {
        int(f.stem.removeprefix("rank")): torch.load(f, weights_only=True)
        for f in sorted(out.glob("rank*.pt"))
    }


def assert_bit_identical(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> None:
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for rank in a:
        for key, tensor in a[rank]["state"].items():
            assert torch.equal(tensor, b[rank]["state"][key]), (rank, key)
        assert a[rank]["valid_losses"] == b[rank]["valid_losses"]


def module_run(tmp_path_factory: pytest.TempPathFactory, name: str, fault: str) -> Path:
    """:func:`elastic_run` once for a module's tests, in a directory and process mark of its own:
    where its ranks saved their weights."""
    tmp = tmp_path_factory.mktemp(name)
    spawn = Spawner(uuid.uuid4().hex, tmp)
    try:
        code, output, _, out = elastic_run(spawn, tmp, "ref", fault)
    finally:
        assert not spawn.cleanup()
    assert code == 0, output
    return out


def finish_noting_processes(
    spawn: Spawner, proc: subprocess.Popen[str], run_dir: Path
) -> tuple[int, str, set[int]]:
    """Run ``proc`` to its end; with its exit status and output, the processes of the test alive
    once epoch 0 is journaled (every worker started, none lost or replaced before epoch 1)."""
    wait_until(lambda: bool(epoch_records(run_dir)), DEADLINE, f"no record in {run_dir}'s journal")
    first = set(marked_pids(spawn.mark))
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    return code, output, first


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Rank 3 lost before epoch 1's first step: the survivors run epoch 1 at three from its
    start, nothing to undo."""
    return weights(
        module_run(tmp_path_factory, "reference", "kill@train-step:rank=3:epoch=1:step=0:world=0")
    )


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The validation losses of the same run with no fault: four workers throughout."""
    losses = weights(module_run(tmp_path_factory, "undisturbed", ""))[0]["valid_losses"]
    assert len(losses) == 3, losses
    return list(losses)


ROUNDING = 1e-5
"""How far apart (relatively) the validation losses of worlds of other sizes may be: the same
rows and steps, summed in another order across the ranks, in float32."""


def world_changes(run_dir: Path) -> list[dict[str, Any]]:
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished", result
    return list(result["world_changes"])


@pytest.mark.xdist_group("elastic")  # the reference run, made once for the group
def test_workers_one_minor_version_older_than_the_coordinator_change_world_and_finish(
    spawn: Spawner, tmp_path: Path, reference: dict[int, dict[str, Any]]
):
    """Four workers of the previous minor protocol version (their frames carry its ``m`` and lack
    the fields this one added) and this version's coordinator: one is killed mid-epoch, the
    others form a new world and finish, bit-identical to the reference, and the coordinator
    never calls a frame malformed."""
    proc, run_dir, out = start_elastic(
        spawn,
        tmp_path,
        "run",
        "kill@train-step:rank=3:epoch=1:step=2:world=0",
        program="older_minor.py",
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    (change,) = world_changes(run_dir)
    assert (change["epoch"], change["from"], change["to"]) == (1, 4, 3)
    assert "malformed" not in output and "skipped field" not in output, output
    assert_bit_identical(weights(out), reference)


@pytest.mark.parametrize(
    ("fault", "lost"),
    [
        ("kill@train-step:rank=3:epoch=1:step=2:world=0", 3),
        ("kill@valid-step:rank=1:epoch=1:step=0:world=0", 1),
        ("kill@train-step:rank=0:epoch=1:step=2:world=0", 0),
        # after epoch 0's decision, in its checkpoint's collective write: epoch 1 is next
        ("kill@checkpoint-write:rank=3:epoch=0", 3),
    ],
    ids=["train-step", "validation", "rank-0-the-store-host", "checkpoint-write"],
)
@pytest.mark.xdist_group("elastic")  # one test process: the module's two runs made once
def test_a_killed_rank_leaves_the_others_training_and_the_weights_bit_identical(
    spawn: Spawner,
    tmp_path: Path,
    reference: dict[int, dict[str, Any]],
    undisturbed: list[float],
    fault: str,
    lost: int,
):
    proc, run_dir, out = start_elastic(spawn, tmp_path, "run", fault)
    code, output, first = finish_noting_processes(spawn, proc, run_dir)
    assert code == 0, output
    (change,) = world_changes(run_dir)
    assert (change["epoch"], change["from"], change["to"], change["generation"]) == (1, 4, 3, 1)
    assert change["lost"][0].startswith(f"rank {lost} ")
    assert change["restore"] == "memory" and "checkpoint" not in change, change
    assert "continuing with 3 workers from the start of epoch 1" in output
    assert f"done: best epoch 2 of 3 (worker {lost} lost on the way)" in output
    assert "resuming" not in output  # restored from memory, no checkpoint read
    records = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [(r["epoch"], r["world_size"], r["generation"]) for r in epochs] == [
        (0, 4, 0),
        (1, 3, 1),
        (2, 3, 1),
    ]
    final = weights(out)
    assert {final[r]["pid"] for r in final} <= first  # the survivors never restarted
    assert_bit_identical(final, reference)
    # with a fixed global batch, a world of three takes the same steps as one of four
    assert final[0]["valid_losses"] == pytest.approx(undisturbed, rel=ROUNDING)


@BOTH_STARTS
def test_ranks_lost_one_after_another_end_the_run_below_the_least_naming_them(
    spawn: Spawner, tmp_path: Path
):
    # rank 1 of every world dies at its first step: 4 -> 3 -> 2 -> below --min-workers 2
    code, output, run_dir, _ = elastic_run(
        spawn, tmp_path, "run", "kill@train-step:rank=1:step=0", least=2
    )
    assert code != 0, output
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "aborted"
    assert "1 worker left, fewer than --min-workers 2; the run cannot go on" in result["reason"]
    # the last world's rank 1 was the fourth worker; its exit or its closed connection, whichever
    # the coordinator heard of first within the settle window, names it
    assert result["reason"].startswith("rank 1 (worker "), result["reason"]
    assert "/local-3 " in result["reason"]
    assert (
        "was killed by SIGKILL" in result["reason"] or "closed its connection" in result["reason"]
    )
    assert output.count("continuing with") == 2, output


def rank_pids(mark: str, ranks: set[int]) -> list[int]:
    """The run's worker processes started as these ranks (their ``EPOCHAL_RANK``)."""
    found = []
    for pid in marked_pids(mark):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(entry == f"EPOCHAL_RANK={rank}".encode() for rank in ranks for entry in environ):
            found.append(pid)
    return found


def test_two_ranks_lost_at_once_make_one_change_down_to_the_least(spawn: Spawner, tmp_path: Path):
    """Ranks 2 and 3 SIGKILLed together while epoch 1 trains: one change of world, 4 -> 2, that
    names both; the two left are exactly --min-workers and finish the run."""
    proc, run_dir, out = start_elastic(
        spawn, tmp_path, "run", "", least=2, script=("--step-delay", "0.2")
    )
    wait_until(
        lambda: any(r["kind"] == "epoch" for r in epoch_records(run_dir)),
        DEADLINE,
        "no epoch decided",
    )
    doomed = rank_pids(spawn.mark, {2, 3})
    assert len(doomed) == 2, doomed
    for pid in doomed:
        os.kill(pid, signal.SIGKILL)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    (change,) = world_changes(run_dir)
    assert (change["from"], change["to"], change["generation"]) == (4, 2, 1), change
    assert sorted(loss.split(" ")[1] for loss in change["lost"]) == ["2", "3"], change
    assert output.count("continuing with 2 workers") == 2, output  # a line per loss, one change
    final = weights(out)
    assert sorted(final) == [0, 1]
    for key, tensor in final[0]["state"].items():
        assert torch.equal(tensor, final[1]["state"][key]), key


def stopped_pids(mark: str) -> list[int]:
    """The run's processes frozen by SIGSTOP (state T)."""
    stopped = []
    for pid in marked_pids(mark):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                stopped.append(pid)
        except OSError:
            continue
    return stopped


def test_a_frozen_rank_is_dropped_the_others_carry_on_and_woken_it_is_refused(
    spawn: Spawner, tmp_path: Path
):
    """A rank frozen mid-step keeps its connections open, so its peers' collective never fails by
    itself (gloo has no abort): the coordinator drops the rank after the heartbeat timeout, and
    each survivor shuts its group's connections as the new world is decided, which ends the
    collective it is blocked in. Woken after that, the frozen worker is refused in one line."""
    proc, run_dir, _ = start_elastic(
        spawn,
        tmp_path,
        "run",
        "stop@train-step:rank=2:epoch=1:step=2:world=0",
        options=("--heartbeat-timeout", "3"),
    )
    wait_until(
        lambda: len(stopped_pids(spawn.mark)) == 1,
        DEADLINE,
        lambda: f"frozen processes: {stopped_pids(spawn.mark)}, not one",
    )
    (frozen,) = stopped_pids(spawn.mark)
    wait_until(
        lambda: any(r["kind"] == "world" for r in epoch_records(run_dir)),
        DEADLINE,
        "no change of world with rank 2 frozen",
    )
    os.kill(frozen, signal.SIGCONT)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    (change,) = world_changes(run_dir)
    assert (change["epoch"], change["from"], change["to"]) == (1, 4, 3)
    assert change["lost"][0].startswith("rank 2 "), change
    assert "sent nothing for" in change["lost"][0], change
    assert "this worker was dropped from the run" in output, output
    assert "done: best epoch 2 of 3 (worker 2 lost on the way)" in output, output
    epochs = [r for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    assert [(r["epoch"], r["world_size"]) for r in epochs] == [(0, 4), (1, 3), (2, 3)]


REPLACED_EPOCHS = 12
"""The replaced-worker run's epochs: 11 of them (44 s) for the replacement to join in."""


@pytest.mark.parametrize("mode", ["replicated", "sharded", "fully_sharded"])
def test_a_lost_worker_is_replaced_at_the_next_boundary_and_the_others_never_stop(
    spawn: Spawner, tmp_path: Path, mode: str
):
    """``--max-restarts 1`` in an elastic run: the launcher starts a replacement for the killed
    worker, which waits as a standby and joins at the next epoch boundary with rank 0's state,
    sent over the data plane (in the sharded modes, gathered onto rank 0 at the boundary and
    resharded as it arrives); the survivors never restart and no checkpoint is read for the join
    (the sharded modes restore the lost shard from the checkpoint of epoch 0). Every rank then
    holds the same weights (the replica check compares them after each epoch where each rank
    holds the whole model, and the files here at the end), bit for bit those of a run with the
    same world sizes at the same epochs and no fault. In ``fully_sharded`` the run ends with the
    best epoch's weights (each rank's copy of them is a shard of its world's, so a world that
    changed takes them from the best epoch's checkpoint, on every rank alike)."""
    parallel = ("--parallel", mode)
    best = mode == "fully_sharded"
    proc, run_dir, out = start_elastic(
        spawn,
        tmp_path,
        "run",
        "kill@train-step:rank=3:epoch=1:step=2:world=0",
        epochs=REPLACED_EPOCHS,
        options=("--max-restarts", "1"),
        # epochs of about four seconds while the world is short of a worker: tens of seconds
        # for the replacement to start and join while the run trains; fast once it is whole
        script=("--step-delay", "1.0", "--slow-below", "4", *parallel),
        restore_best=best,
    )
    code, output, first = finish_noting_processes(spawn, proc, run_dir)
    assert code == 0, output
    lost, joined = world_changes(run_dir)
    assert (lost["epoch"], lost["from"], lost["to"], lost["joined"]) == (1, 4, 3, [])
    assert (joined["from"], joined["to"], joined["lost"]) == (3, 4, [])
    assert joined["epoch"] >= 2 and joined["generation"] == 2, joined
    assert joined["restore"] == "peers" and "checkpoint" not in joined, joined
    (newcomer,) = joined["joined"]
    assert newcomer.endswith("/local-3/1"), newcomer
    assert "worker 3 lost: started" in output and "replacement 1 of 1" in output, output
    assert "joins: 4 workers from epoch" in output, output
    assert output.count("took rank 0's state") == 1, output  # said by the newcomer alone
    assert "(worker 3 lost and replaced)" in output, output
    assert "resuming" not in output  # nothing read from a checkpoint
    epochs = [r for r in epoch_records(run_dir) if r["kind"] == "epoch"]
    sizes = [(r["epoch"], r["world_size"]) for r in epochs]
    j = joined["epoch"]
    got = f"joins: 4 workers from epoch {j} (the state sent from rank 0 over the data plane)"
    assert got in output, output
    assert lost["restore"] == ("memory" if mode == "replicated" else "checkpoint"), lost
    assert sizes == [(0, 4)] + [(e, 3) for e in range(1, j)] + [
        (e, 4) for e in range(j, REPLACED_EPOCHS)
    ]
    final = weights(out)
    assert sorted(final) == [0, 1, 2, 3]
    assert {final[r]["pid"] for r in (0, 1, 2)} <= first  # the survivors never restarted
    assert final[3]["pid"] not in first  # the replacement
    for rank in (1, 2, 3):
        for key, tensor in final[0]["state"].items():
            assert torch.equal(tensor, final[rank]["state"][key]), (rank, key)
    # every world's process group closed with the run, its threads ended before train returned
    assert {r: f["gloo_threads"] for r, f in final.items()} == {r: [] for r in final}

    # The reference, where the join epoch is known only now: 4 workers train epoch 0, a resume
    # at 3 the epochs up to the join, a resume at 4 the rest; each resumes from the checkpoint of
    # the epoch before it, and the one at 4 loads a checkpoint that three ranks wrote.
    ref_dir, ref_out = tmp_path / "ref", tmp_path / "ref-out"
    for size, upto, had in ((4, 1, None), (3, j, 4), (4, REPLACED_EPOCHS, 3)):
        code, said = spawn.finish(
            spawn.epochal(
                "run",
                *("--nproc", str(size), "--min-workers", "3", "--epochs", str(upto)),
                *(() if best else ("--no-restore-best",)),
                *("--run-dir", str(ref_dir)),
                *(str(SCRIPTS / "linear.py"), "--out", str(ref_out), *parallel),
            ),
            DEADLINE,
        )
        assert code == 0, said
        if had is not None:
            assert f"at {size} workers where it had {had} (the state resharded" in said, said
    spawn.assert_none_left()
    epochs = [r for r in epoch_records(ref_dir) if r["kind"] == "epoch"]
    assert [(r["epoch"], r["world_size"]) for r in epochs] == sizes
    reference = weights(ref_out)
    assert sorted(reference) == [0, 1, 2, 3]
    for rank in range(4):
        for key, tensor in reference[rank]["state"].items():
            assert torch.equal(tensor, final[rank]["state"][key]), (rank, key)
    assert len(reference[0]["valid_losses"]) == REPLACED_EPOCHS
    assert final[0]["valid_losses"] == reference[0]["valid_losses"]


# ---------------------------------------------------------------- from the last checkpoint

CHECKPOINTED = (
    # the survivors load the checkpoint of epoch 1: every epoch is a new best here, so each is
    # checkpointed; epoch 2 is redone at three from it
    ("sharded", ()),
    ("fully_sharded", ()),
    ("replicated", ("--no-snapshot",)),
)


@pytest.mark.parametrize(
    ("mode", "more"), CHECKPOINTED, ids=["sharded", "fully_sharded", "replicated-no-snapshot"]
)
def test_a_lost_shard_is_restored_from_the_last_checkpoint_resharded_bit_identical(
    spawn: Spawner, tmp_path: Path, mode: str, more: tuple[str, ...]
):
    """Where no rank's copy holds the whole state (a shard per rank, or copies switched off),
    the survivors of a killed rank load the last committed checkpoint, which DCP reshards to
    three, and redo the epoch after it; the survivors' processes go on. The reference loses the
    rank before epoch 2's first step: the same world sizes, nothing of epoch 2 to undo."""
    script = ("--parallel", mode, *more)
    killed = elastic_run(
        spawn, tmp_path, "run", "kill@train-step:rank=3:epoch=2:step=2:world=0", script=script
    )
    reference = elastic_run(
        spawn, tmp_path, "ref", "kill@train-step:rank=3:epoch=2:step=0:world=0", script=script
    )
    for code, output, run_dir, _ in (killed, reference):
        assert code == 0, output
        (change,) = world_changes(run_dir)
        assert (change["epoch"], change["from"], change["to"]) == (2, 4, 3), change
        assert (change["restore"], change["checkpoint"]) == ("checkpoint", 1), change
        assert "continuing with 3 workers from the checkpoint of epoch 1" in output, output
        assert output.count("epoch 2 again from the checkpoint of epoch 1") == 3, output
        assert "FutureWarning" not in output, output
    weights_killed, weights_reference = weights(killed[3]), weights(reference[3])
    assert_bit_identical(weights_killed, weights_reference)
