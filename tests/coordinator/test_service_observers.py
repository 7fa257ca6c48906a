"""What the service tells a run's observers, and how it sets up its ROUTER, over real sockets.

A recording observer sees the calls in order: the start, the joins, every journal record with a
snapshot, the end, and nothing after the end (a late snapshot would turn status.json's "finished"
back into a running state).
"""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import Mapping
from typing import Any

import pytest
import zmq
import zmq.asyncio

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.coordinator.serve.journal import JournalError
from epochal.coordinator.serve.oslimits import backlog_for
from epochal.errors import RunAborted
from epochal.observe import Observers, RunObserver, RunStart, StatusSnapshot, World
from epochal.protocol import (
    Abort,
    Checkpointed,
    Decision,
    Done,
    EpochReady,
    EpochReport,
    Finish,
    Go,
)
from tests.conftest import hello
from tests.coordinator.conftest import serve
from tests.coordinator.test_service import FakeWorker, join_all


class Recorder(RunObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_start(self, start: RunStart) -> None:
        self.calls.append(("on_start", start))

    def on_join(self, world: World) -> None:
        self.calls.append(("on_join", world))

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        self.calls.append(("on_epoch", (dict(record), status)))

    def on_status(self, snapshot: StatusSnapshot) -> None:
        self.calls.append(("on_status", snapshot))

    def on_end(self, result: Mapping[str, Any]) -> None:
        self.calls.append(("on_end", dict(result)))

    def close(self) -> None:
        self.calls.append(("close", None))

    def names(self, *, statuses: bool = False) -> list[str]:
        return [n for n, _ in self.calls if statuses or n != "on_status"]

    def args(self, name: str) -> list[Any]:
        return [a for n, a in self.calls if n == name]


async def run_epochs(
    workers: list[FakeWorker], epochs: int, *, of: int, checkpoint: bool = False
) -> None:
    """Run the first ``epochs`` of a run of ``of`` epochs, as the workers speak them."""
    for w in workers:
        await w.send(EpochReady(epoch=0, train_batches=3, valid_batches=1))
    for w in workers:
        assert isinstance(await w.recv(), Go)
    for epoch in range(epochs):
        ready = EpochReady(epoch + 1, 3, 1) if epoch + 1 < of else None
        for w in workers:
            await w.send(
                EpochReport(
                    epoch=epoch,
                    train_loss_sum=2.0 / (epoch + 1),
                    train_count=1,
                    valid_loss_sum=1.0 / (epoch + 1),
                    valid_count=1,
                    ready=ready,
                )
            )
        for w in workers:
            decision = await w.recv()
            assert isinstance(decision, Decision)
        if checkpoint:
            await workers[0].send(Checkpointed(epoch=epoch))


async def test_observers_hear_start_joins_epochs_and_end_in_order_and_nothing_after(ctx, tmp_path):
    recorder = Recorder()
    coordinator, task = await serve(ctx, recorder, epochs=3, run_dir=tmp_path / "run")
    workers = await join_all(ctx, coordinator, 2)
    await run_epochs(workers, 3, of=3, checkpoint=True)
    for w in workers:
        assert isinstance(await w.recv(), Finish)
        await w.send(Done())
    summary = await asyncio.wait_for(task, 5)
    assert summary.epochs_run == 3

    assert recorder.names() == [
        "on_start",
        "on_join",
        "on_join",
        *["on_epoch"] * 6,
        "on_end",
    ]
    (start,) = recorder.args("on_start")
    assert (start.run_id, start.world_size, start.epochs, start.attempt) == (
        coordinator.run_id,
        2,
        3,
        0,
    )
    assert start.endpoint == coordinator.endpoint and start.resumed_from is None
    assert start.config["epochs"] == 3 and "token" not in start.config
    # the last hello completes the rendezvous and assigns the ranks in the same turn
    assert recorder.args("on_join") == [World(1, 2), World(2, 2, ("testhost", "testhost"))]
    records = [record for record, _ in recorder.args("on_epoch")]
    assert [(r["kind"], r["epoch"]) for r in records] == [
        (kind, epoch) for epoch in range(3) for kind in ("epoch", "checkpoint")
    ]
    assert all("time" in r and r["attempt"] == 1 for r in records)
    # the records the observers got are the ones in the journal, but for the go of the first
    # epoch, which is kept for a restarted coordinator only
    lines = (tmp_path / "run" / "epochs.jsonl").read_text().splitlines()
    journal = [json.loads(line) for line in lines]
    assert [r for r in journal if r["kind"] != "go"] == records
    assert [(r["kind"], r["epoch"]) for r in journal if r["kind"] == "go"] == [("go", 0)]
    last_epoch, snapshot = recorder.args("on_epoch")[-2]
    assert last_epoch["valid_loss"] == pytest.approx(1 / 3)
    assert snapshot.run_id == coordinator.run_id and snapshot.world_size == 2
    assert (snapshot.joined, snapshot.best_epoch) == (2, 2)
    assert snapshot.round_seconds is not None and snapshot.round_seconds >= 0
    assert [r.rank for r in snapshot.ranks] == [0, 1]
    assert recorder.args("on_end") == [
        {
            "status": "finished",
            "run_id": coordinator.run_id,
            "best_epoch": 2,
            "best_loss": pytest.approx(1 / 3),
            "epochs_run": 3,
            "attempt": 1,
        }
    ]
    # every snapshot came before the end; the owner, not the service, closes the observers
    assert recorder.names(statuses=True)[-1] == "on_end"
    assert "close" not in recorder.names()


async def test_every_heartbeat_brings_a_snapshot_until_the_end(ctx):
    recorder = Recorder()
    coordinator, task = await serve(ctx, recorder, heartbeat_interval=0.05)
    worker = FakeWorker(ctx, coordinator.endpoint, "w0")
    await worker.send(hello("w0"))
    await worker.recv()
    for _ in range(200):  # each pass lets the loop run; the bound is a count, not a duration
        if len(recorder.args("on_status")) >= 3:
            break
        await asyncio.sleep(0.05)
    coordinator.abort("enough")
    assert isinstance(await worker.recv(), Abort)
    with pytest.raises(RunAborted, match="enough"):
        await asyncio.wait_for(task, 5)
    statuses = recorder.args("on_status")
    assert len(statuses) >= 3
    assert all(s.state == "rendezvous" and s.joined == 1 for s in statuses)
    assert recorder.names(statuses=True)[-1] == "on_end"
    assert recorder.args("on_end") == [
        {"status": "aborted", "run_id": coordinator.run_id, "reason": "enough", "attempt": 1}
    ]


async def test_an_abort_is_the_last_word_and_a_refusal_is_counted(ctx):
    recorder = Recorder()
    coordinator, task = await serve(ctx, recorder, token="s3cret", heartbeat_interval=0.05)
    stranger = FakeWorker(ctx, coordinator.endpoint, "stranger")
    await stranger.send(hello("stranger", token="wrong"))
    await stranger.recv()
    for _ in range(200):
        if recorder.args("on_status"):
            break
        await asyncio.sleep(0.05)
    assert recorder.args("on_status")[-1].refused == 1
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(2)]
    for w in workers:
        await w.send(hello(w.worker_id, token="s3cret"))
        await w.recv()
    await workers[0].send(EpochReady(epoch=0, train_batches=1, valid_batches=None))  # out of step
    with pytest.raises(RunAborted, match="out of step"):
        await asyncio.wait_for(task, 5)
    names = recorder.names(statuses=True)
    assert names.count("on_end") == 1 and names[-1] == "on_end"
    assert recorder.args("on_end")[0]["status"] == "aborted"


async def test_one_set_of_observers_spans_a_restart(ctx, tmp_path):
    """As the launcher and `epochal coordinator` do: the same observers, attempt 0 then 1."""
    recorder = Recorder()
    observers = Observers([recorder])
    config = dict(run_dir=tmp_path / "run", checkpoint_every=1)
    first, task = await serve(ctx, observers, **config)
    workers = await join_all(ctx, first, 2)
    await run_epochs(workers, 1, of=2, checkpoint=True)
    first.abort("a worker died")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)
    again, task = await serve(ctx, observers, attempt=1, **config)
    workers = await join_all(ctx, again, 2)
    again.abort("stop here")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)
    starts = recorder.args("on_start")
    assert [(s.attempt, s.resumed_from) for s in starts] == [(0, None), (1, 0)]
    assert recorder.names().count("on_end") == 2
    observers.close()
    assert recorder.names()[-1] == "close"


async def test_the_router_is_sized_and_monitored_for_the_run(ctx):
    """The listen backlog fits every worker connecting at once, and connections the ROUTER could
    not accept (out of file descriptors) are named by the rendezvous timeout, not blamed on
    missing workers."""
    lines: list[str] = []
    cfg = CoordinatorConfig(world_size=300, rendezvous_timeout=0.3)
    coordinator = Coordinator(cfg, context=ctx, log=lines.append)
    await coordinator.start()
    assert coordinator._socket is not None
    assert coordinator._socket.getsockopt(zmq.BACKLOG) == backlog_for(300)
    assert coordinator._guard is not None
    coordinator._guard.on_event(zmq.EVENT_ACCEPT_FAILED, errno.EMFILE)
    assert any("too many open files" in line for line in lines), lines
    with pytest.raises(RunAborted) as aborted:
        await asyncio.wait_for(coordinator.run(), 5 + cfg.rendezvous_timeout)
    assert "only 0 of 300 workers joined" in aborted.value.reason
    assert "could not accept connections 1 times for want of file descriptors" in (
        aborted.value.reason
    )
    assert not coordinator._monitor.watching  # disabled and closed with the socket


async def test_an_abort_that_cannot_be_recorded_for_want_of_files_says_how_to_raise_the_limit(
    ctx, tmp_path
):
    lines: list[str] = []
    cfg = CoordinatorConfig(world_size=2, run_dir=tmp_path / "run")
    coordinator = Coordinator(cfg, context=ctx, log=lines.append)
    await coordinator.start()
    assert coordinator._journal is not None

    def out_of_files(record: object) -> None:
        raise JournalError(errno.EMFILE, "cannot write result.json: Too many open files")

    coordinator._journal.result = out_of_files  # type: ignore[method-assign]
    coordinator.abort("stop")
    with pytest.raises(RunAborted, match="stop"):
        await asyncio.wait_for(coordinator.run(), 5)
    (line,) = [line for line in lines if "not recorded" in line]
    assert "cannot write result.json: Too many open files: too many open files" in line
    assert "ulimit -n 66" in line
