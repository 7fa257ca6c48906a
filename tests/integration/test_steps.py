"""Epochs of N steps, for real: a run killed mid-pass resumes bit-identical at its world size,
with the same per-step learning rates, and at another world size every sample of each pass is
trained exactly once (by recorded ids)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from epochal.steprates import warmup_cosine
from tests.integration.conftest import SCRIPTS, Spawner, epoch_records

pytestmark = pytest.mark.slow

DEADLINE = 120.0
STEPS = (
    "--epochs",
    "5",
    "--steps-per-epoch",
    "3",
    "--lr-schedule",
    "warmup-cosine:warmup=4,min=0.1",
)
# a warm-up over epoch 0 into epoch 1, then a cosine to 0.1 at the run's 15th step
# passes of 5 global batches: epoch 1 ends one batch into pass 1, the checkpoint a resume reads
KILL = "kill@train-step:rank=0:epoch=2:step=1"


def stepped(spawn: Spawner, run_dir: Path, out: Path, world: int, style: str, **env: str):
    samples = "40" if style == "sampler" else "60"  # global batches of 8, or 12: 5 a pass
    return spawn.epochal(
        "run",
        "--nproc",
        str(world),
        *STEPS,
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "stepped.py"),
        "--out",
        str(out),
        "--style",
        style,
        "--samples",
        samples,
        **env,
    )


def batches_trained(out: Path) -> list[tuple[int, list[int]]]:
    """Every process's recorded batches in order, as (world size, global batch's ids): the
    ranks' i-th lines of one world make its i-th global batch."""
    by_world: dict[int, dict[int, list[list[int]]]] = {}
    for path in sorted(out.glob("ids-*.txt"), key=lambda p: p.stat().st_mtime):
        lines = [list(map(int, line.split())) for line in path.read_text().splitlines()]
        world, rank = lines[0][:2]
        by_world.setdefault(world, {})[rank] = [line[4:] for line in lines]
    out_batches = []
    for world, ranks in by_world.items():
        for i in range(min(len(r) for r in ranks.values())):
            out_batches.append((world, sorted(i_ for r in ranks.values() for i_ in r[i])))
    return out_batches


def rates_stepped(out: Path, rank: int) -> list[float]:
    """Rank ``rank``'s learning rate after each of its optimizer steps, in order, across the
    processes that wrote ``out`` (a killed run's, then its resume's). A rate of 0 is left out:
    a resume gives the optimizer its state tensors by a step at rate 0 before loading them."""
    rates = []
    for path in sorted(out.glob("lr-*.txt"), key=lambda p: p.stat().st_mtime):
        lines = [line.split() for line in path.read_text().splitlines()]
        rates.append([float(lr) for _, r, lr in lines if int(r) == rank and float(lr) != 0])
    return [lr for process in rates for lr in process]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("steps")
    spawner = Spawner("steps-" + os.urandom(4).hex(), tmp)
    try:
        code, output = spawner.finish(
            stepped(spawner, tmp / "run", tmp / "out", 2, "sampler"), DEADLINE
        )
        assert code == 0, output
    finally:
        spawner.cleanup()
    return tmp


@pytest.mark.xdist_group("steps-unbroken")  # one test process, one unbroken run
def test_each_epoch_record_says_its_steps_and_where_the_data_stands(unbroken):
    records = [r for r in epoch_records(unbroken / "run") if r["kind"] == "epoch"]
    # 3 global batches of 8 an epoch, 5 a pass of 40 samples
    assert [(r["steps"], r["data_pass"], r["data_offset"]) for r in records] == [
        (3, 0, 24),
        (3, 1, 8),
        (3, 1, 32),
        (3, 2, 16),
        (3, 3, 0),
    ]
    trained = [ids for _, ids in batches_trained(unbroken / "out")]
    assert len(trained) == 15
    for p in range(3):  # each pass, across epochs, holds every sample once
        assert sorted(i for ids in trained[5 * p : 5 * p + 5] for i in ids) == list(range(40))


@pytest.mark.xdist_group("steps-unbroken")  # one test process, one unbroken run
def test_the_rate_of_each_step_is_the_schedules_at_its_global_step(unbroken):
    expected = [0.05 * warmup_cosine(s, warmup=4, steps=15, floor=0.1) for s in range(15)]
    for rank in (0, 1):
        assert rates_stepped(unbroken / "out", rank) == expected
    assert [r["lr_factor"] for r in epoch_records(unbroken / "run") if r["kind"] == "epoch"] == [
        warmup_cosine(3 * e + 2, warmup=4, steps=15, floor=0.1) for e in range(5)
    ]  # the factor at each epoch's last step


@pytest.mark.xdist_group("steps-unbroken")  # one test process, one unbroken run
def test_killed_mid_pass_resumes_bit_identical(spawn, tmp_path, unbroken):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    code, output = spawn.finish(
        stepped(spawn, run_dir, out, 2, "sampler", EPOCHAL_FAULT=KILL), DEADLINE
    )
    assert code != 0, output
    # epoch 1's checkpoint, unless the kill reached rank 0 before its background write of it
    # was done and told (then 0's)
    last = max(r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "checkpoint")
    assert last in (0, 1)
    kept = 3 * (last + 1)
    code, output = spawn.finish(stepped(spawn, run_dir, out, 2, "sampler"), DEADLINE)
    assert code == 0, output
    assert "resuming" in output
    for rank in (0, 1):
        # the killed run stepped epochs 0 and 1 and epoch 2's step 0; the resume steps the
        # epochs after the last checkpoint at the rates of the run that was never killed
        rates = rates_stepped(out, rank)
        assert len(rates) == 7 + 15 - kept
        assert rates[:kept] + rates[7:] == rates_stepped(unbroken / "out", rank)
        x = torch.load(unbroken / "out" / f"rank{rank}.pt")
        y = torch.load(out / f"rank{rank}.pt")
        for name in x["model"]:
            assert torch.equal(x["model"][name], y["model"][name]), name
    spawn.assert_none_left()


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_resumed_at_another_world_size_each_sample_of_a_pass_is_trained_once(
    spawn, tmp_path, before, after
):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    code, output = spawn.finish(
        stepped(spawn, run_dir, out, before, "passes", EPOCHAL_FAULT=KILL), DEADLINE
    )
    assert code != 0, output
    # the last checkpoint the coordinator journaled: epoch 1's, unless the kill reached rank 0
    # before its background write of that checkpoint was done and told, and then epoch 0's
    kept = 3 * (1 + max(r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "checkpoint"))
    code, output = spawn.finish(stepped(spawn, run_dir, out, after, "passes"), DEADLINE)
    assert code == 0, output
    assert "goes on with pass" not in output  # the same global batch in every world
    trained = batches_trained(out)
    # the killed world's decided epochs up to that checkpoint, then the resumed world's rest
    first = [ids for world, ids in trained if world == before][:kept]
    second = [ids for world, ids in trained if world == after]
    assert kept in (3, 6) and len(second) == 15 - kept
    passes = [*first, *second]
    for p in range(3):
        assert sorted(i for ids in passes[5 * p : 5 * p + 5] for i in ids) == list(range(60))
    spawn.assert_none_left()


def test_a_loader_of_its_own_resumed_mid_pass_at_another_world_size_says_so_in_one_line(
    spawn, tmp_path
):
    """A DistributedSampler loader of the script's own, 4 samples a rank, killed at 2 workers
    one batch into pass 1 and resumed at 3: its global batch grows from 8 to 12, so the rest of
    the pass is not the samples left, and the run says so, naming epochal.batches."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    code, output = spawn.finish(
        stepped(spawn, run_dir, out, 2, "sampler", EPOCHAL_FAULT=KILL), DEADLINE
    )
    assert code != 0, output
    # epoch 1's checkpoint, written by rank 0 while epoch 2 trains: the kill, one step into
    # epoch 2, may come before its write is done, and the resume then starts after epoch 0's
    last = max(r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "checkpoint")
    assert last in (0, 1)
    done = 3 * (last + 1)  # global batches stepped up to it, 5 a pass
    code, output = spawn.finish(stepped(spawn, run_dir, out, 3, "sampler"), DEADLINE)
    assert code == 0, output
    (line,) = [line for line in output.splitlines() if "goes on with pass" in line]
    assert (
        f"epoch {last + 1} goes on with pass {done // 5}, {done % 5} of its 5 global batches "
        "in, in global batches of 12 samples where it read 8" in line
    ), line
    assert "epochal.batches(" in line
    spawn.assert_none_left()


def last_tries(out: Path) -> dict[int, list[int]]:
    """Every epoch's sample ids, all ranks together, from its last try: an epoch interrupted by
    a lost worker is redone in the next world, and its first try's batches are not kept."""
    tries: dict[int, dict[int, list[int]]] = {}
    for path in out.glob("ids-*.txt"):
        for line in path.read_text().splitlines():
            _, _, epoch, generation, *ids = map(int, line.split())
            tries.setdefault(epoch, {}).setdefault(generation, []).extend(ids)
    return {epoch: by[max(by)] for epoch, by in sorted(tries.items())}


PASS_EPOCHS = 12
"""Epochs of a pass in the elastic run: 144 samples in global batches of 6, 2 steps an epoch."""


def test_a_worker_lost_and_one_joining_mid_pass_train_each_sample_of_the_pass_once(spawn, tmp_path):
    """Three workers, --min-workers 2: rank 2 is killed in epoch 1, the two left redo it from its
    start and go on with the rest of the pass re-sliced over two, and the replacement joins at a
    later boundary of the same pass, taking the position with the state. Batches at two workers
    are slow, so the replacement joins well before the pass ends."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = spawn.epochal(
        "run",
        *("--nproc", "3", "--min-workers", "2", "--max-restarts", "1"),
        *("--epochs", str(2 * PASS_EPOCHS), "--steps-per-epoch", "2"),
        *("--run-dir", str(run_dir), str(SCRIPTS / "stepped.py"), "--out", str(out)),
        *("--style", "passes", "--samples", "144", "--global-batch", "6"),
        *("--step-delay", "0.5", "--slow-below", "3"),
        EPOCHAL_FAULT="kill@train-step:rank=2:epoch=1:step=1:world=0",
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    changes = [r for r in epoch_records(run_dir) if r["kind"] == "world"]
    assert [(c["epoch"], c["from"], c["to"]) for c in changes[:1]] == [(1, 3, 2)], changes
    (joined,) = changes[1:]
    assert (joined["from"], joined["to"]) == (2, 3), joined
    assert 1 < joined["epoch"] < PASS_EPOCHS, joined  # mid-pass, after the loss
    trained = last_tries(out)
    assert sorted(trained) == list(range(2 * PASS_EPOCHS))
    for p in range(2):
        ids = [i for e in range(p * PASS_EPOCHS, (p + 1) * PASS_EPOCHS) for i in trained[e]]
        assert sorted(ids) == list(range(144)), p
    spawn.assert_none_left()


def test_a_custom_loop_reads_epochal_batches_at_the_position_its_context_gives(spawn, tmp_path):
    """A custom loop (epochal.join, run_epochs) with --steps-per-epoch 3 over passes of 5 global
    batches: each epoch's context says where the data stands, and a loader of epochal.batches
    made there reads each sample of a pass once, across epochs."""
    out = tmp_path / "out"
    proc = spawn.epochal(
        "run",
        *("--nproc", "2", "--epochs", "4", "--steps-per-epoch", "3"),
        *("--run-dir", str(tmp_path / "run"), str(SCRIPTS / "stepped_loop.py"), "--out", str(out)),
    )
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    contexts, trained = set(), {}
    for path in out.glob("ids-*.txt"):
        for line in path.read_text().splitlines():
            kind, *fields = line.split()
            if kind == "ctx":
                contexts.add(tuple(fields))
            else:
                _, _, epoch, step, *ids = map(int, fields)
                trained.setdefault((epoch, step), []).extend(ids)
    # (epoch, steps, global batches consumed, pass, batch of the pass) at each epoch's start
    assert sorted(contexts) == [
        ("0", "3", "0", "0", "0"),
        ("1", "3", "3", "0", "3"),
        ("2", "3", "6", "1", "1"),
        ("3", "3", "9", "1", "4"),
    ]
    batches = [trained[key] for key in sorted(trained)]  # global batches, ranks together
    assert len(batches) == 12
    for p in range(2):  # each pass is 5 global batches of 8
        assert sorted(i for ids in batches[5 * p : 5 * p + 5] for i in ids) == list(range(40))
    spawn.assert_none_left()
