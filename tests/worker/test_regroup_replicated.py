"""Mode replicated in a world that loses a rank and then admits a newcomer, for real: gloo process
groups in spawned processes, a rank SIGKILLed in the middle of an all_reduce.

Four ranks train epoch 0 (fp16, so a loss scaler has state too), take the snapshot of epoch 1's
start and train it; rank 1 dies inside the gradients' all_reduce of epoch 1's third batch. The
three survivors raise, leave the broken group (:func:`leave`), form generation 1 on a new store
(renumbered 0, 1, 2), rebuild the strategy and restore the snapshot, and train epoch 1 again at
size 3. A fresh three-rank run (other processes, other models) from the state each survivor
recorded at epoch 1's start, through torch's own ``load_state_dict``, must reach the same bits.
Then a newcomer joins: the survivors leave generation 1 (rank 0 first enters an all_reduce the
others never join, and must raise as soon as they have left), generation 2 has four ranks, the
survivors rebuild, the newcomer wraps a model of its own, and :func:`share` gives every rank
rank 0's model, optimizer and scaler, with every unpickler of every process refusing to run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from epochal.worker.checkpoints.checkpoint import set_rng_state
from epochal.worker.regroup import Snapshot, leave, rebuild, share
from epochal.worker.strategies import Layout, wrap
from tests.worker.elastic import (
    COLLECTIVE_TIMEOUT,
    CPU,
    fails,
    form_group,
    load,
    make_model,
    make_optimizer,
    no_unpickling,
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

DOOMED, NEWCOMER, DIE_AT = 1, 4, 2
SURVIVORS = [0, 2, 3]  # old ranks, in the order that renumbers them 0, 1, 2
DEADLINE = 60 + 3 * COLLECTIVE_TIMEOUT  # spawns, three generations' stores, one epoch each


def build(seed: int) -> Any:
    model = make_model(seed)
    return wrap(model, make_optimizer(model), CPU, mode="replicated", precision="fp16")


def newcomer(tmp: Path) -> None:
    """Process 4: waits (as a standby would) for generation 2, in which it is rank 3."""
    form_group(tmp, 2, 3, 4, wait=DEADLINE)
    strategy = build(99)
    with no_unpickling() as tried:
        transfer = share(strategy)
    save(tmp, "grown-3", {"state": record(strategy), "tried": tried, "nbytes": transfer.nbytes})
    dist.destroy_process_group()


def member(index: int, tmp: Path) -> None:
    if index == NEWCOMER:
        newcomer(tmp)
        return
    form_group(tmp, 0, index, 4)
    strategy = build(10 + index)
    train_epoch(strategy, 0, index, 4)
    snapshot = Snapshot.take(strategy)  # epoch 1 starts
    start = record(strategy)
    die_at = DIE_AT if index == DOOMED else None
    error = fails(lambda: train_epoch(strategy, 1, index, 4, die_at=die_at, note=tmp / "death"))
    raised = time.monotonic()
    message = f"{type(error).__name__}: {error}"
    seconds_to_leave = leave(strategy, error)
    del error

    rank = SURVIVORS.index(index)
    form_group(tmp, 1, rank, 3)
    formed = time.monotonic()
    strategy = rebuild(strategy, Layout.from_group(CPU))
    snapshot.restore(strategy)
    restored = record(strategy)
    train_epoch(strategy, 1, rank, 3)
    save(
        tmp,
        f"survivor-{rank}",
        {
            "start": start,
            "restored": restored,
            "redone": record(strategy),
            "error": message,
            "raised": raised,
            "formed": formed,
            "leave_seconds": seconds_to_leave,
            "snapshot_bytes": snapshot.nbytes,
        },
    )

    # the boundary: generation 2 admits the newcomer. Rank 0 first enters an all_reduce that the
    # others never join: it must raise as soon as they have left, not at the collective timeout
    if rank == 0:
        blocked = fails(lambda: dist.all_reduce(torch.ones(1)))
        save(tmp, "blocked", f"{type(blocked).__name__}: {blocked}")
        leave(strategy, blocked)
        del blocked
    else:
        leave(strategy)
    form_group(tmp, 2, rank, 4)
    strategy = rebuild(strategy, Layout.from_group(CPU))
    with no_unpickling() as tried:
        share(strategy)
    save(tmp, f"grown-{rank}", {"state": record(strategy), "tried": tried})
    dist.destroy_process_group()


def fresh(index: int, tmp: Path, survivors: str) -> None:
    """A three-rank run of epoch 1 from what survivor ``index`` recorded at its start."""
    form_group(tmp, 0, index, 3)
    strategy = build(50 + index)
    start = load(Path(survivors), f"survivor-{index}")["start"]
    strategy.model.load_state_dict(start["model"])
    strategy.optimizer.load_state_dict(start["optim"])
    strategy.policy.scaler.load_state_dict(start["scaler"])
    set_rng_state(start["rng"])
    train_epoch(strategy, 1, index, 3)
    save(tmp, f"fresh-{index}", record(strategy))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("replicated")
    spawn(member, 5, tmp, deadline=DEADLINE, killed=frozenset({DOOMED}))
    reference = tmp_path_factory.mktemp("fresh")
    spawn(fresh, 3, reference, str(tmp), deadline=DEADLINE)
    return {
        "death": float((tmp / "death").read_text()),
        "blocked": load(tmp, "blocked"),
        "survivors": [load(tmp, f"survivor-{r}") for r in range(3)],
        "fresh": [load(reference, f"fresh-{r}") for r in range(3)],
        "grown": [load(tmp, f"grown-{r}") for r in range(4)],
    }


@pytest.mark.timeout(3 * DEADLINE)
def test_survivors_raise_because_the_lost_rank_is_gone_not_because_they_timed_out(run):
    for survivor in run["survivors"]:
        assert "timed out" not in survivor["error"].lower(), survivor["error"]
        assert survivor["raised"] > run["death"]
    # at the next boundary, a rank blocked in a collective its peers never join (they leave)
    assert "timed out" not in run["blocked"].lower(), run["blocked"]
    # each survivor's time from the kill to its error and to the new group, for docs/elastic.md
    for r, survivor in enumerate(run["survivors"]):
        print(
            f"survivor {r}: raised {survivor['raised'] - run['death']:.3f} s after the kill, "
            f"left in {survivor['leave_seconds']:.3f} s, in generation 1 "
            f"{survivor['formed'] - run['death']:.3f} s after the kill: {survivor['error'][:90]}"
        )


@pytest.mark.timeout(3 * DEADLINE)
def test_restore_gives_back_the_start_of_the_epoch_bit_for_bit(run):
    for survivor in run["survivors"]:
        same(survivor["restored"], survivor["start"])  # model, optimizer, scaler, generators
        assert survivor["snapshot_bytes"] > 0


@pytest.mark.timeout(3 * DEADLINE)
def test_the_epoch_redone_at_size_3_equals_a_fresh_three_rank_run_from_that_state(run):
    for survivor, fresh_rank in zip(run["survivors"], run["fresh"], strict=True):
        same(survivor["redone"], fresh_rank)
    assert not torch.equal(  # the epoch did train: the check above compares something
        run["survivors"][0]["redone"]["model"]["0.weight"],
        run["survivors"][0]["start"]["model"]["0.weight"],
    )


@pytest.mark.timeout(3 * DEADLINE)
def test_a_newcomer_gets_rank_0s_model_optimizer_and_scaler_without_unpickling(run):
    grown = run["grown"]
    for r, got in enumerate(grown):
        assert got["tried"] == [], f"rank {r} unpickled:\n{got['tried'][0]}"
        state = {k: v for k, v in got["state"].items() if k != "rng"}
        same(state, {k: v for k, v in grown[0]["state"].items() if k != "rng"}, f"rank {r}")
    rank0_before = {k: v for k, v in run["survivors"][0]["redone"].items() if k != "rng"}
    same({k: v for k, v in grown[0]["state"].items() if k != "rng"}, rank0_before)
    assert grown[0]["state"]["optim"]["state"], "the shared optimizer has state"
    assert grown[3]["nbytes"] > 0
