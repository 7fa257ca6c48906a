"""Frames are bound to the worker that was admitted, not to the routing identity they arrive under.

A hostile process can connect under any routing identity (and ROUTER_HANDOVER gives it the
connection); these tests take an admitted worker's identity from a socket that never saw the
worker's session and check that nothing it sends acts for that worker.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.coordinator.rules.sessions import Sessions
from epochal.errors import RunAborted
from epochal.protocol import (
    Abort,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Finish,
    Go,
    Joined,
    OpenStore,
    Reject,
    StoreReady,
    Welcome,
    encode,
)
from tests.conftest import hello
from tests.coordinator.conftest import serve
from tests.coordinator.test_service import OTHER_FP, FakeWorker

WAIT = CoordinatorConfig(world_size=2).heartbeat_timeout
"""Seconds the coordinator may take over one frame: silent for longer, it would abort the run."""


async def until(condition, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def forge(ctx, coordinator: Coordinator, identity: str, *messages) -> None:
    """Connect under ``identity`` (taking it over), send ``messages`` without a session, and
    leave once the coordinator has dropped every one of them."""
    dropped = coordinator.forged_frames + len(messages)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coordinator.endpoint)
    try:
        for message in messages:
            await sock.send(encode(message))
        await until(lambda: coordinator.forged_frames >= dropped, "the forged frames to be dropped")
    finally:
        sock.close()


async def run_two_epochs(workers: list[FakeWorker]) -> None:
    for w in workers:
        await w.send(EpochReady(epoch=0, train_batches=2, valid_batches=None))
    for w in workers:
        assert isinstance(await w.recv(), Go)
    for epoch in range(2):
        ready = EpochReady(1, 2, None) if epoch == 0 else None
        for w in workers:
            await w.send(EpochReport(epoch, 1.0, 1, 0.0, 0, ready=ready))
        for w in workers:
            await w.recv()  # the decision, with the next epoch's go
    for w in workers:
        assert isinstance(await w.recv(), Finish)
        await w.send(Done())


async def test_a_forged_failed_under_a_workers_identity_does_not_abort_the_run(ctx):
    coordinator, task = await serve(ctx)
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(2)]
    for w in workers:
        await w.send(hello(w.worker_id))
        assert isinstance(await w.recv(), Joined)
    assert isinstance(await workers[0].recv(), OpenStore)
    await workers[0].send(StoreReady(host="127.0.0.1", port=4242))
    for w in workers:
        assert isinstance(await w.recv(), Welcome)
    await forge(ctx, coordinator, "w1", Failed(reason="forged"))
    # an accepted Failed would have started the failure settle window that ends in an abort
    assert coordinator.machine.watchdog.failure_deadline is None
    assert not task.done()
    # the takeover cost w1 its connection (real workers' identities carry a random part, so a
    # stranger cannot name them); the run ends for the reason given here, not the forged one
    coordinator.abort("test over")
    with pytest.raises(RunAborted, match=r"^test over$"):
        await asyncio.wait_for(task, 5)


async def test_a_forged_store_ready_for_rank_0_is_ignored(ctx):
    coordinator, task = await serve(ctx)
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(2)]
    for w in workers:
        await w.send(hello(w.worker_id))
        assert isinstance(await w.recv(), Joined)
    assert isinstance(await workers[0].recv(), OpenStore)
    await forge(ctx, coordinator, "w0", StoreReady(host="6.6.6.6", port=666))
    # nobody was welcomed to the forger's store: the coordinator still waits for rank 0's own
    assert coordinator.phase.value == "store"
    coordinator.abort("test over")
    with pytest.raises(RunAborted, match=r"^test over$"):
        await asyncio.wait_for(task, 5)
    for message in [await workers[1].recv()]:
        assert isinstance(message, Abort)  # not a Welcome naming 6.6.6.6


async def test_a_frame_with_another_workers_session_is_dropped(ctx):
    coordinator, task = await serve(ctx)
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(2)]
    for w in workers:
        await w.send(hello(w.worker_id))
        assert isinstance(await w.recv(), Joined)
    assert workers[0].session != workers[1].session
    # rank 1 presents rank 0's session: still not rank 0's frame
    stolen = workers[1].session
    workers[1].session = workers[0].session
    await workers[1].send(Failed(reason="with a session that is not mine"))
    await until(lambda: coordinator.forged_frames >= 1, "the frame to be dropped")
    workers[1].session = stolen
    assert coordinator.machine.watchdog.failure_deadline is None  # not taken as rank 0's failure
    assert not task.done()
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_a_duplicate_worker_id_mid_run_is_refused_and_the_run_goes_on(ctx):
    coordinator, task = await serve(ctx)
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(2)]
    for w in workers:
        await w.send(hello(w.worker_id))
        assert isinstance(await w.recv(), Joined)
    assert isinstance(await workers[0].recv(), OpenStore)
    await workers[0].send(StoreReady(host="127.0.0.1", port=4242))
    for w in workers:
        assert isinstance(await w.recv(), Welcome)
    # a second process with the same worker id (on its own connection, as real clients are)
    twin = FakeWorker.__new__(FakeWorker)
    twin.worker_id, twin.session = "w1", ""
    twin.sock = ctx.socket(zmq.DEALER)
    twin.sock.setsockopt(zmq.IDENTITY, b"w1#another-process")
    twin.sock.setsockopt(zmq.LINGER, 0)
    twin.sock.connect(coordinator.endpoint)
    await twin.send(hello("w1"))
    reply = await twin.recv()
    assert isinstance(reply, Reject) and reply.code == "refused"
    assert "a worker with id 'w1' has already joined" in reply.reason
    await run_two_epochs(workers)
    summary = await asyncio.wait_for(task, 10)
    assert summary.epochs_run == 2


async def test_a_strangers_foreign_model_after_the_rendezvous_is_refused_not_fatal(ctx):
    coordinator, task = await serve(ctx)
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(2)]
    for w in workers:
        await w.send(hello(w.worker_id))
        assert isinstance(await w.recv(), Joined)
    stranger = FakeWorker(ctx, coordinator.endpoint, "stranger")
    await stranger.send(hello("stranger", fingerprint=OTHER_FP))
    reply = await stranger.recv()
    assert isinstance(reply, Reject) and reply.code == "refused"
    assert isinstance(await workers[0].recv(), OpenStore)  # the run went on
    assert not task.done()
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)
    for w in workers[1:]:
        assert isinstance(await w.recv(), Abort)


def test_sessions_are_random_per_worker_and_checked_with_the_key():
    sessions = Sessions()
    a = sessions.issue(b"a", "")
    b = sessions.issue(b"b", "key-b")
    assert a != b and len(a) >= 40
    assert sessions.issue(b"a", "") == a  # a retried hello keeps its session
    assert sessions.check(b"a", a, "")
    assert not sessions.check(b"a", b, "")
    assert not sessions.check(b"a", "", "")
    assert not sessions.check(b"b", b, "key-a")  # right secret, another CURVE key
    assert sessions.check(b"b", b, "key-b")
    assert not sessions.same_sender(b"b", "key-a")
    assert not sessions.check(b"nobody", a, "")
    sessions.forget(b"a")
    assert not sessions.check(b"a", a, "")


async def test_control_characters_in_worker_ids_and_hosts_are_escaped_in_the_log(ctx):
    lines: list[str] = []
    coordinator = Coordinator(
        CoordinatorConfig(world_size=2, epochs=1, token="t"), context=ctx, log=lines.append
    )
    await coordinator.start()
    task = asyncio.create_task(coordinator.run())
    evil = "w0\n[epochal] run finished\x1b[2J"
    joined = FakeWorker(ctx, coordinator.endpoint, "a")
    await joined.send(hello(evil, host="h\rost\x07", token="t"))
    assert isinstance(await joined.recv(), Joined)
    refused = FakeWorker(ctx, coordinator.endpoint, "b")
    await refused.send(hello(evil, host="x\x1b]0;title\x07"))  # no token: refused, and logged
    assert isinstance(await refused.recv(), Reject)
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)
    text = "\n".join(lines)
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert all("\n" not in line for line in lines)
    assert "worker w0\\n[epochal] run finished\\x1b[2J joined from h\\rost\\x07" in text
    assert "refused worker w0\\n[epochal] run finished\\x1b[2J from x\\x1b]0;title\\x07" in text
