"""Modes sharded (ZeRO) and fully_sharded (FSDP2) in a world that grows and then loses a rank,
for real (gloo, spawned processes, SIGKILL): no rank holds the whole state, so a newcomer gets
it consolidated in the old group and shared in the new one, and survivors of a loss load the last
checkpoint, resharded by DCP to the smaller world.

Two ranks train epoch 0; at the boundary they :func:`consolidate` (the whole state onto rank 0)
and leave (rank 0 first enters an all_reduce its peer never joins: it must raise as soon as the
peer has left, not at the collective timeout), and form generation 1 with a newcomer (rank 2),
which wraps a model of its own; :func:`share` gives every rank its part of rank 0's state.
Consolidating again in generation 1 must give back the state of generation 0 bit for bit (so
every rank holds its part right), and every rank's whole model must equal it. Every unpickler of
every process refuses to run meanwhile. The three ranks train epoch 1 and checkpoint it; in
epoch 2 rank 1 dies in the middle of a collective, the two survivors form generation 2 and load
that checkpoint: consolidated, it is the state the three ranks held when they wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from epochal.errors import EpochalError
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.regroup import Snapshot, consolidate, leave, rebuild, share
from epochal.worker.strategies import Layout, Strategy, wrap
from tests.worker.elastic import (
    COLLECTIVE_TIMEOUT,
    CPU,
    fails,
    form_group,
    load,
    make_model,
    make_optimizer,
    no_unpickling,
    same,
    save,
    spawn,
    train_epoch,
    whole,
)
from tests.worker.ranks import RANKS

pytestmark = [
    pytest.mark.slow,
    # every test here in one test process: the run (module-scoped) is made once, not once in
    # each test process that draws one of its tests
    RANKS,
]

NEWCOMER, DOOMED, DIE_AT = 2, 1, 1
DEADLINE = 60 + 3 * COLLECTIVE_TIMEOUT


def build(mode: str, seed: int) -> Strategy:
    model = make_model(seed)
    return wrap(model, make_optimizer(model), CPU, mode=mode)


def gathered(strategy: Strategy) -> dict[str, Any] | None:
    """The whole state consolidated onto rank 0 (None elsewhere), and every rank's whole model:
    collective."""
    full = consolidate(strategy)
    return {"full": None if full is None else full.state, "model": whole(strategy.model)}


def member(index: int, tmp: Path, mode: str) -> None:
    checkpoints = tmp / "checkpoints"
    if index == NEWCOMER:
        form_group(tmp, 1, 2, 3, wait=DEADLINE)  # waits, as a standby would, for generation 1
        strategy = build(mode, 99)
        full = None
        tried: list[str] = []
    else:
        form_group(tmp, 0, index, 2)
        strategy = build(mode, 10 + index)
        train_epoch(strategy, 0, index, 2)
        with no_unpickling() as tried:
            full = consolidate(strategy)  # the boundary: rank 0 gathers the whole state
        if index == 0:  # process 1 leaves instead of joining: leaving must close its sockets
            blocked = fails(lambda: dist.all_reduce(torch.ones(1)))
            save(tmp, "blocked", f"{type(blocked).__name__}: {blocked}")
            leave(strategy, blocked)
            del blocked
        else:
            leave(strategy)
        if full is not None:
            save(tmp, "before", full.state)
        form_group(tmp, 1, index, 3)
        strategy = rebuild(strategy, Layout.from_group(CPU))
    with no_unpickling() as more:
        transfer = share(strategy, full=full)
        del full
        after = gathered(strategy)
    save(tmp, f"grown-{index}", {"after": after, "tried": tried + more, "nbytes": transfer.nbytes})

    train_epoch(strategy, 1, index, 3)
    Checkpointer(checkpoints, rank=index, run_id="t").save(1, strategy.state)
    save(tmp, f"checkpointed-{index}", gathered(strategy))
    snapshot = Snapshot.take(strategy)
    die_at = DIE_AT if index == DOOMED else None
    error = fails(lambda: train_epoch(strategy, 2, index, 3, die_at=die_at))
    leave(strategy, error)
    del error
    rank = [0, 2].index(index)
    form_group(tmp, 2, rank, 2)
    strategy = rebuild(strategy, Layout.from_group(CPU))
    refusal = None
    try:
        snapshot.restore(strategy)
    except EpochalError as exc:
        refusal = str(exc)
    Checkpointer(checkpoints, rank=rank, run_id="t").load(1, strategy.state, rng=False)
    snapshot.restore_generators()
    save(tmp, f"loaded-{index}", {"state": gathered(strategy), "refusal": refusal})
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=["sharded", "fully_sharded"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp(request.param)
    spawn(member, 3, tmp, request.param, deadline=DEADLINE, killed=frozenset({DOOMED}))
    return {
        "blocked": load(tmp, "blocked"),
        "before": load(tmp, "before"),
        "grown": [load(tmp, f"grown-{i}") for i in range(3)],
        "checkpointed": load(tmp, "checkpointed-0"),
        "loaded": [load(tmp, f"loaded-{i}") for i in (0, 2)],
    }


@pytest.mark.timeout(3 * DEADLINE)
def test_a_rank_blocked_in_a_collective_raises_once_its_peer_leaves_not_at_the_timeout(run):
    # the peer left holding DDP or FSDP2, ZeRO, and torch's import-time default group
    assert "timed out" not in run["blocked"].lower(), run["blocked"]


@pytest.mark.timeout(3 * DEADLINE)
def test_a_grown_world_holds_the_consolidated_state_on_every_rank_unpickling_nothing(run):
    before, grown = run["before"], run["grown"]
    assert before["optim"]["state"], "the optimizer had state to share"
    same(grown[0]["after"]["full"], before)  # gathered again: every rank held its part
    for index, got in enumerate(grown):
        assert got["tried"] == [], f"process {index} unpickled:\n{got['tried'][0]}"
        same(got["after"]["model"], before["model"], f"process {index}'s whole model")
        assert got["nbytes"] > 0


@pytest.mark.timeout(3 * DEADLINE)
def test_survivors_load_the_last_checkpoint_resharded_to_the_same_values(run):
    reference = run["checkpointed"]
    for survivor in run["loaded"]:
        assert survivor["refusal"] is not None and "checkpoint" in survivor["refusal"]
        same(survivor["state"]["model"], reference["model"])
    same(run["loaded"][0]["state"]["full"], reference["full"])
