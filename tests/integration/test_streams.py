"""A stream that can say where it stands, for real: a run over one, in epochs of N steps with a
per-step OneCycleLR, killed after an epoch and resumed at its world size, trains the very batches
at the very rates of a run that was never killed; resumed at another size it is refused in one
line before training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import SCRIPTS, Spawner, epoch_records

pytestmark = pytest.mark.slow

DEADLINE = 120.0
KILL = "kill@train-step:rank=0:epoch=2:step=1"
# epochs 0 and 1 checkpointed, epoch 2 one step in when rank 0 dies


def streamed(spawn: Spawner, run_dir: Path, out: Path, world: int, **env: str):
    return spawn.epochal(
        "run",
        "--nproc",
        str(world),
        "--epochs",
        "4",
        "--steps-per-epoch",
        "3",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "stepped.py"),
        "--out",
        str(out),
        "--style",
        "stream",
        "--scheduler",
        "onecycle",
        **env,
    )


def by_process(out: Path, kind: str) -> list[list[list[str]]]:
    """The lines of each process's ``kind`` file in ``out``, split, the killed run's first."""
    paths = sorted(out.glob(f"{kind}-*.txt"), key=lambda p: p.stat().st_mtime)
    return [[line.split() for line in p.read_text().splitlines()] for p in paths]


def trained(out: Path, rank: int) -> list[list[list[int]]]:
    """Rank ``rank``'s batches of each process in ``out`` as sample ids, each with its epoch
    first."""
    processes = [[list(map(int, line)) for line in lines] for lines in by_process(out, "ids")]
    mine = [[line[2:3] + line[4:] for line in p if line[1] == rank] for p in processes]
    return [p for p in mine if p]


def rates(out: Path, rank: int) -> list[list[float]]:
    """Rank ``rank``'s rate after each optimizer step of each process in ``out`` (0: a resume's
    step that gives the optimizer its state tensors, left out)."""
    mine = [
        [float(lr) for _, r, lr in p if int(r) == rank and float(lr) != 0]
        for p in by_process(out, "lr")
    ]
    return [p for p in mine if p]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("streams")
    spawner = Spawner("streams-" + os.urandom(4).hex(), tmp)
    try:
        code, output = spawner.finish(streamed(spawner, tmp / "run", tmp / "out", 2), DEADLINE)
        assert code == 0, output
    finally:
        spawner.cleanup()
    return tmp / "out"


def test_killed_mid_stream_resumes_with_the_same_batches_and_rates(spawn, tmp_path, unbroken):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    code, output = spawn.finish(streamed(spawn, run_dir, out, 2, EPOCHAL_FAULT=KILL), DEADLINE)
    assert code != 0, output
    # epoch 1's checkpoint, unless the kill reached rank 0 before its background write of it
    # was done and told (then 0's)
    last = max(r["epoch"] for r in epoch_records(run_dir) if r["kind"] == "checkpoint")
    assert last in (0, 1)
    code, output = spawn.finish(streamed(spawn, run_dir, out, 2), DEADLINE)
    assert code == 0, output
    assert "resuming" in output
    for rank in (0, 1):
        (whole,) = trained(unbroken, rank)
        assert [b[0] for b in whole] == [e for e in range(4) for _ in range(3)]
        # the rank's share of the 40 ids, 4 a batch, round and round
        assert [i for b in whole for i in b[1:]] == [(rank + 2 * k) % 40 for k in range(48)]
        killed, resumed = trained(out, rank)
        assert [b for b in killed if b[0] <= last] + resumed == whole
        (unbroken_rates,) = rates(unbroken, rank)
        killed_rates, resumed_rates = rates(out, rank)
        assert killed_rates[: 3 * (last + 1)] + resumed_rates == unbroken_rates
        assert len(set(unbroken_rates)) == 12  # OneCycleLR: a rate of its own at every step
        x = torch.load(unbroken / f"rank{rank}.pt")
        y = torch.load(out / f"rank{rank}.pt")
        for name in x["model"]:
            assert torch.equal(x["model"][name], y["model"][name]), name
    spawn.assert_none_left()


def test_resumed_at_another_world_size_is_refused_in_one_line(spawn, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    code, output = spawn.finish(streamed(spawn, run_dir, out, 2, EPOCHAL_FAULT=KILL), DEADLINE)
    assert code != 0, output
    before = set(out.glob("ids-*.txt"))
    code, output = spawn.finish(streamed(spawn, run_dir, out, 3), DEADLINE)
    assert code != 0, output
    lines = [line for line in output.splitlines() if "belongs to that rank" in line]
    assert lines, output
    assert "epochal.batches" in lines[0], lines[0]
    refused = set(out.glob("ids-*.txt")) - before
    assert len(refused) == 3
    assert all(p.read_text() == "" for p in refused)  # refused before any batch was trained
    spawn.assert_none_left()
