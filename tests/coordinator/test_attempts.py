"""One id per run, a number per attempt (:mod:`epochal.coordinator.serve.attempts`): a coordinator
started again on a run directory keeps the run's id and counts one more attempt, while what its
workers are sent names the attempt, so that an earlier attempt's workers and store keys are told
apart from this one's."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from epochal.coordinator import CoordinatorConfig
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.runstate import RunState
from epochal.coordinator.serve.attempts import RunAttempt, attempt_of, workers_id
from epochal.errors import RunAborted
from epochal.observe.statusfile import describe
from epochal.protocol import Joined, OpenStore, StoreReady, Welcome
from tests.conftest import hello
from tests.coordinator.conftest import serve
from tests.coordinator.test_service import FakeWorker


async def aborted(coordinator, task) -> None:
    coordinator.abort("the test is over")
    with contextlib.suppress(RunAborted):
        await asyncio.wait_for(task, 5)


async def ids_sent(ctx, coordinator) -> set[str]:
    """The run ids two workers are sent as they join: in the store's opening and the welcomes."""
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(2)]
    for w in workers:
        await w.send(hello(w.worker_id))
        assert isinstance(await w.recv(), Joined)
    store = await workers[0].recv()
    assert isinstance(store, OpenStore)
    await workers[0].send(StoreReady(host="127.0.0.1", port=4242, key="k"))
    welcomes = [await w.recv() for w in workers]
    assert all(isinstance(w, Welcome) for w in welcomes)
    return {store.run_id, *(w.run_id for w in welcomes)}


async def test_a_run_started_again_keeps_its_id_and_counts_its_attempts(ctx, tmp_path):
    run_dir = tmp_path / "run"
    first, task = await serve(ctx, run_dir=run_dir)
    run_id = first.run_id
    assert (first.attempt.number, first.attempt.attempt_id) == (1, run_id)
    assert await ids_sent(ctx, first) == {run_id}
    await aborted(first, task)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["run_id"], result["attempt"]) == (run_id, 1)

    again, task = await serve(ctx, run_dir=run_dir)
    try:
        assert again.run_id == run_id and again.attempt.number == 2
        stored = json.loads((run_dir / "run.json").read_text())
        assert (stored["run_id"], stored["attempt"]) == (run_id, 2)
        # the workers of this attempt know it by an id of its own: nothing of the first's
        # (a worker still running, a key left in a store) is taken for this one's
        assert again.attempt.attempt_id != run_id
        assert await ids_sent(ctx, again) == {again.attempt.attempt_id}
        assert stored["attempt_id"] == again.attempt.attempt_id
    finally:
        await aborted(again, task)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["run_id"], result["attempt"]) == (run_id, 2)
    assert describe(run_dir).startswith(f"run {run_id}, attempt 2, in {run_dir}: aborted")


def test_the_attempt_of_a_run_directory(tmp_path: Path) -> None:
    loop = LoopState.from_config(CoordinatorConfig(world_size=1, epochs=1))
    assert attempt_of(RunState(loop=loop), "new") == RunAttempt("new", 1, "new")
    # run.json written before attempts were numbered: its id was its workers' too
    old = {"run_id": "r1", "config": {}}
    assert workers_id(old) == "r1"
    made = attempt_of(RunState(loop=loop, run_file=old), "new")
    assert (made.run_id, made.number, made.named) == ("r1", 2, "run r1, attempt 2")
    assert made.attempt_id not in ("r1", "new")
    third = {"run_id": "r1", "attempt": 2, "attempt_id": "a2", "config": {}}
    assert workers_id(third) == "a2"
    assert attempt_of(RunState(loop=loop, run_file=third), "new").number == 3
