"""Mode main in a world that loses ranks, for real (gloo, spawned processes, SIGKILL): rank 0 alone
holds the optimizer, so the survivors restore from memory only while it lives.

Four ranks train epoch 0 and checkpoint it; in epoch 1 rank 2 dies just before the step's
collectives. Old rank 0 survived: the three survivors restore their snapshots (memory) and get
back the start of epoch 1 bit for bit, optimizer included on the new rank 0; they train epoch 1
again at size 3 and checkpoint it. In epoch 2 the new rank 0 dies: the snapshot of the new rank 0
holds no optimizer, so :meth:`Snapshot.restore` refuses there (changing nothing) and the two
survivors take the documented fallback: the last checkpoint, loaded by two
(``Checkpointer.load(..., rng=False)``), and their own generators from the snapshot. They get
the values the lost rank 0 held when epoch 2 started. That checkpoint is written as a session
writes main's: rank 0 of the three alone writes the whole state, in the background
(``Checkpointer.save_behind``), here waited for before epoch 2, so that it is there to load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from epochal.errors import EpochalError
from epochal.protocol import Restore
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.regroup import Snapshot, leave, rebuild
from epochal.worker.strategies import Layout, Strategy, wrap
from tests.worker.elastic import (
    COLLECTIVE_TIMEOUT,
    CPU,
    fails,
    form_group,
    load,
    make_model,
    make_optimizer,
    record,
    same,
    save,
    spawn,
    train_epoch,
)
from tests.worker.ranks import RANKS

pytestmark = [
    pytest.mark.slow,
    # every test here in one test process: the run (module-scoped) is made once, not once in
    # each test process that draws one of its tests
    RANKS,
]

DIE_AT = 1
FIRST_LOST, SECOND_LOST = 2, 0  # processes: old rank 2 in epoch 1, then process 0 (rank 0)
DEADLINE = 60 + 3 * COLLECTIVE_TIMEOUT


def regroup(
    strategy: Strategy, error: BaseException, tmp: Path, generation: int, rank: int, world: int
) -> Strategy:
    leave(strategy, error)
    form_group(tmp, generation, rank, world)
    return rebuild(strategy, Layout.from_group(CPU))


def member(index: int, tmp: Path) -> None:
    checkpoints = tmp / "checkpoints"
    form_group(tmp, 0, index, 4)
    model = make_model(10 + index)
    strategy = wrap(model, make_optimizer(model), CPU, mode="main")
    train_epoch(strategy, 0, index, 4)
    Checkpointer(checkpoints, rank=index, run_id="t").save(0, strategy.state)

    snapshot = Snapshot.take(strategy)
    start = record(strategy)
    die_at = DIE_AT if index == FIRST_LOST else None
    error = fails(lambda: train_epoch(strategy, 1, index, 4, die_at=die_at))
    survivors = [0, 1, 3]
    rank = survivors.index(index)
    strategy = regroup(strategy, error, tmp, 1, rank, 3)
    del error
    from_memory = strategy.snapshot_scope.restore_after([FIRST_LOST]) is not Restore.CHECKPOINT
    snapshot.restore(strategy)
    restored = record(strategy)
    train_epoch(strategy, 1, rank, 3)
    behind = Checkpointer(checkpoints, rank=rank, run_id="t").save_behind(1, strategy.state)
    if behind is not None:  # rank 0, whose state is the whole
        behind.wait()

    snapshot = Snapshot.take(strategy)
    start2 = record(strategy)
    save(tmp, f"first-{index}", {"start": start, "restored": restored, "memory": from_memory})
    save(tmp, f"start2-{index}", start2)
    die_at = DIE_AT if index == SECOND_LOST else None
    error = fails(lambda: train_epoch(strategy, 2, rank, 3, die_at=die_at))
    survivors = [1, 3]
    rank = survivors.index(index)
    strategy = regroup(strategy, error, tmp, 2, rank, 2)
    del error
    from_memory = strategy.snapshot_scope.restore_after([SECOND_LOST]) is not Restore.CHECKPOINT
    refusal = None
    before = record(strategy)
    if rank == 0:  # the new rank 0's snapshot was taken on old rank 1: no optimizer in it
        try:
            snapshot.restore(strategy)
        except EpochalError as exc:
            refusal = str(exc)
    unchanged = record(strategy)
    Checkpointer(checkpoints, rank=rank, run_id="t").load(1, strategy.state, rng=False)
    snapshot.restore_generators()
    save(
        tmp,
        f"second-{index}",
        {
            "memory": from_memory,
            "refusal": refusal,
            "before": before,
            "unchanged": unchanged,
            "loaded": record(strategy),
        },
    )
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("main")
    spawn(member, 4, tmp, deadline=DEADLINE, killed=frozenset({FIRST_LOST, SECOND_LOST}))
    return {
        "first": {i: load(tmp, f"first-{i}") for i in (0, 1, 3)},
        "start2": {i: load(tmp, f"start2-{i}") for i in (0, 1, 3)},
        "second": {i: load(tmp, f"second-{i}") for i in (1, 3)},
    }


@pytest.mark.timeout(2 * DEADLINE)
def test_with_rank_0_alive_every_survivor_restores_the_epoch_start_from_memory(run):
    for index, first in run["first"].items():
        assert first["memory"] is True
        same(first["restored"], first["start"], f"process {index}")
    assert run["first"][0]["restored"]["optim"]["state"], "rank 0's snapshot holds the optimizer"


@pytest.mark.timeout(2 * DEADLINE)
def test_with_rank_0_lost_memory_is_refused_and_the_checkpoint_restores_rank_0s_state(run):
    lost_root = run["start2"][SECOND_LOST]  # what the lost rank 0 held when epoch 2 started
    new_root, other = run["second"][1], run["second"][3]
    for second in (new_root, other):
        assert second["memory"] is False
    assert new_root["refusal"] is not None and "checkpoint" in new_root["refusal"]
    same(new_root["unchanged"], new_root["before"])  # the refusal changed nothing
    same(new_root["loaded"]["optim"], lost_root["optim"])  # old rank 0's optimizer, on new rank 0
    for index, second in run["second"].items():
        same(second["loaded"]["model"], lost_root["model"], f"process {index}")
        same(second["loaded"]["rng"], run["start2"][index]["rng"], f"process {index}")
