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
        by_world.setdefault(world, {})[rank] = [line[2:] for line in lines]
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


def test_the_rate_of_each_step_is_the_schedules_at_its_global_step(unbroken):
    expected = [0.05 * warmup_cosine(s, warmup=4, steps=15, floor=0.1) for s in range(15)]
    for rank in (0, 1):
        assert rates_stepped(unbroken / "out", rank) == expected
    assert [r["lr_factor"] for r in epoch_records(unbroken / "run") if r["kind"] == "epoch"] == [
        warmup_cosine(3 * e + 2, warmup=4, steps=15, floor=0.1) for e in range(5)
    ]  # the factor at each epoch's last step


def test_killed_mid_pass_resumes_bit_identical(spawn, tmp_path, unbroken):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    code, output = spawn.finish(
        stepped(spawn, run_dir, out, 2, "sampler", EPOCHAL_FAULT=KILL), DEADLINE
    )
    assert code != 0, output
    assert max(r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "checkpoint") == 1
    code, output = spawn.finish(stepped(spawn, run_dir, out, 2, "sampler"), DEADLINE)
    assert code == 0, output
    assert "resuming" in output
    for rank in (0, 1):
        # the killed run stepped epochs 0 and 1 (checkpointed) and epoch 2's step 0; the resume
        # steps epochs 2 to 4 at the rates of the run that was never killed
        rates = rates_stepped(out, rank)
        assert len(rates) == 7 + 9
        assert rates[:6] + rates[7:] == rates_stepped(unbroken / "out", rank)
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
    code, output = spawn.finish(stepped(spawn, run_dir, out, after, "passes"), DEADLINE)
    assert code == 0, output
    trained = batches_trained(out)
    # the killed world's two decided epochs (6 global batches), then the resumed world's 9
    first = [ids for world, ids in trained if world == before][:6]
    second = [ids for world, ids in trained if world == after]
    assert len(second) == 9
    passes = [*first, *second]
    for p in range(3):
        assert sorted(i for ids in passes[5 * p : 5 * p + 5] for i in ids) == list(range(60))
    spawn.assert_none_left()
