"""The coordinator service over real ZeroMQ sockets, with scripted workers speaking the protocol.

No torch and no processes: each fake worker is a DEALER socket in the test's event loop. The rules
with a clock (timeouts, silence, stalls) are tested with a given clock in test_machine.py and
test_watchdog.py; these tests check that the service carries frames and actions faithfully.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.errors import RunAborted
from epochal.protocol import (
    MAX_FRAME_BYTES,
    MAX_PARAMS,
    PROTOCOL_VERSION,
    Abort,
    Decision,
    DescribeModel,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Fingerprint,
    Finish,
    Go,
    Heartbeat,
    Hello,
    Joined,
    Message,
    OpenStore,
    ParamSpec,
    Record,
    Reject,
    StoreReady,
    Welcome,
    decode,
    encode,
)
from epochal.protocol.paging import model_page
from tests.conftest import hello
from tests.coordinator.conftest import serve

PARAMS = (ParamSpec("w", (2, 3), "float32"),)
OTHER_FP = Fingerprint(digest="b" * 64, torch_version="x", entries=1)
OTHER_PARAMS = (ParamSpec("w", (3, 3), "float32"),)


class FakeWorker:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        worker_id: str,
        params: tuple[ParamSpec, ...] = PARAMS,
    ) -> None:
        self.worker_id = worker_id
        self.params = params
        # its model's entries, sent a page at a time when asked, as the real client does
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

        self.session = ""
        # as the real client: the session from Joined/Welcome goes with every frame but a hello
        self.asked: list[int] = []
        # the pages the coordinator asked for

    async def send(self, message: Message) -> None:
        session = "" if isinstance(message, Hello) else self.session
        await self.sock.send(encode(message, session=session))

    async def recv(self, timeout: float = 5.0) -> Message:
        """The next message that is not a heartbeat (a request for a page of the model's entries
        is answered on the way, as the real client answers it)."""
        while True:
            data = await asyncio.wait_for(self.sock.recv(), timeout)
            message = decode(data)
            if isinstance(message, Joined | Welcome):
                self.session = message.session
            if isinstance(message, DescribeModel):
                self.asked.append(message.first)
                await self.send(model_page(self.params, message.first))
                continue
            if not isinstance(message, Heartbeat):
                return message


async def join_all(ctx, coordinator, n: int) -> list[FakeWorker]:
    workers = [FakeWorker(ctx, coordinator.endpoint, f"w{i}") for i in range(n)]
    for w in workers:
        await w.send(hello(w.worker_id))
        assert isinstance(await w.recv(), Joined)
    store = await workers[0].recv()
    assert isinstance(store, OpenStore)
    await workers[0].send(StoreReady(host="127.0.0.1", port=4242, key="s3cret"))
    for w in workers:
        welcome = await w.recv()
        assert isinstance(welcome, Welcome)
        assert (welcome.store_host, welcome.store_port) == ("127.0.0.1", 4242)
        assert welcome.store_key == "s3cret"  # the store's secret, to admitted workers only
    return workers


async def test_a_whole_run_with_scripted_losses(ctx):
    coordinator, task = await serve(ctx, epochs=3)
    workers = await join_all(ctx, coordinator, 2)
    valid_sums = [(8.0, 2.0), (3.0, 3.0), (5.0, 5.0)]  # global: 10/4, 6/4, 10/4
    for w in workers:  # the first epoch is announced on its own; each later one in a report
        await w.send(EpochReady(epoch=0, train_batches=5, valid_batches=2))
    for w in workers:
        go = await w.recv()
        assert go == Go(epoch=0, train_batches=5, valid_batches=2, lr_factor=1.0)
    for epoch, sums in enumerate(valid_sums):
        ready = EpochReady(epoch + 1, 5, 2) if epoch < 2 else None
        for w, s in zip(workers, sums, strict=True):
            await w.send(
                EpochReport(
                    epoch=epoch,
                    train_loss_sum=1.0,
                    train_count=1,
                    valid_loss_sum=s,
                    valid_count=2,
                    ready=ready,
                )
            )
        for w in workers:
            decision = await w.recv()
            assert isinstance(decision, Decision)
            assert decision.valid_loss == pytest.approx(sum(sums) / 4)
            assert decision.is_best == (epoch in (0, 1))
            assert decision.stop == (epoch == 2)
            go = None if epoch == 2 else Go(epoch + 1, 5, 2, 1.0)
            assert decision.go == go  # the next epoch's go rides along
    for w in workers:
        finish = await w.recv()
        assert finish == Finish(best_epoch=1, best_loss=1.5, epochs_run=3, restore_best=True)
        await w.send(Done())
    summary = await asyncio.wait_for(task, 5)
    assert (summary.best_epoch, summary.epochs_run) == (1, 3)


def records_built(monkeypatch: pytest.MonkeyPatch, record: type[Record]) -> list[Record]:
    """Every ``record`` built from now on (each runs its checks as it is made, also when msgspec
    builds it from a frame)."""
    built: list[Record] = []
    check = record._validate

    def counting(self: Record) -> None:
        built.append(self)
        check(self)

    monkeypatch.setattr(record, "_validate", counting)
    return built


async def test_a_retried_hello_is_known_by_its_bytes_and_its_fingerprint_is_not_decoded(
    ctx, monkeypatch
):
    """A hello re-sent unchanged gets the answer the decoded one gets, without decoding; a hello
    that differs in any byte, or the same bytes from another peer, are decoded and judged."""
    decoded = records_built(monkeypatch, Fingerprint)
    coordinator, task = await serve(ctx, token="s3cret")
    first = FakeWorker(ctx, coordinator.endpoint, "first")
    await first.send(hello("first", token="s3cret"))
    joined = await first.recv()
    assert isinstance(joined, Joined) and len(decoded) == 1
    for _ in range(3):
        await first.send(hello("first", token="s3cret"))
        assert await first.recv() == joined  # the same answer: count, world size and session
    assert len(decoded) == 1
    # another peer with the same bytes: decoded, and refused as the duplicate it is
    twin = FakeWorker(ctx, coordinator.endpoint, "twin")
    await twin.send(hello("first", token="s3cret"))
    reply = await twin.recv()
    assert isinstance(reply, Reject) and "already joined" in reply.reason
    assert len(decoded) == 2
    # the same peer with a changed hello: decoded, and judged as before
    await first.send(hello("first", token="s3cret", pid=2))
    assert await first.recv() == joined
    await first.send(hello("other", token="s3cret"))
    reply = await first.recv()
    assert isinstance(reply, Reject) and "already joined as worker first" in reply.reason
    assert len(decoded) == 4
    # after the welcome a retry is answered with the welcome again, still without decoding
    second = FakeWorker(ctx, coordinator.endpoint, "second")
    await second.send(hello("second", token="s3cret"))
    assert isinstance(await second.recv(), Joined)
    assert isinstance(await first.recv(), OpenStore)
    await first.send(StoreReady(host="127.0.0.1", port=4242, key="k"))
    welcome = await second.recv()
    assert isinstance(welcome, Welcome) and isinstance(await first.recv(), Welcome)
    decoded.clear()
    await second.send(hello("second", token="s3cret"))
    assert await second.recv() == welcome
    assert decoded == []
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_uneven_batches_abort_every_worker(ctx):
    coordinator, task = await serve(ctx)
    workers = await join_all(ctx, coordinator, 2)
    await workers[0].send(EpochReady(epoch=0, train_batches=48, valid_batches=None))
    await workers[1].send(EpochReady(epoch=0, train_batches=47, valid_batches=None))
    for w in workers:
        abort = await w.recv()
        assert isinstance(abort, Abort)
        assert "rank 0 has 48, rank 1 has 47 train batches" in abort.reason
    with pytest.raises(RunAborted, match="rank 1 has 47"):
        await asyncio.wait_for(task, 5)


async def test_surplus_duplicate_and_strangers_are_refused_without_ending_the_run(ctx):
    coordinator, task = await serve(ctx, token="s3cret")
    first = FakeWorker(ctx, coordinator.endpoint, "first")
    await first.send(hello("first", token="s3cret"))
    assert isinstance(await first.recv(), Joined)
    await first.send(hello("first", token="s3cret"))  # a retried hello is answered again
    assert isinstance(await first.recv(), Joined)

    cases = [
        (hello("first", token="s3cret"), "already joined"),
        (hello("tok", token="wrong"), "wrong or missing job token"),
        (hello("job", token="s3cret", job="other"), "runs job 'epochal'"),
        (hello("big", token="s3cret", rank_hint=7), "ranks run 0..1"),
    ]
    for i, (message, expected) in enumerate(cases):
        stranger = FakeWorker(ctx, coordinator.endpoint, f"stranger{i}")
        try:
            await stranger.send(message)
            reply = await stranger.recv()
        finally:  # closed here: the next one replaces it, and a socket left to the collector
            stranger.sock.close(linger=0)  # warns in whichever test the collector runs in
        assert isinstance(reply, Reject), reply
        assert expected in reply.reason

    second = FakeWorker(ctx, coordinator.endpoint, "second")
    await second.send(hello("second", token="s3cret"))
    assert isinstance(await second.recv(), Joined)
    surplus = FakeWorker(ctx, coordinator.endpoint, "third")
    await surplus.send(hello("third", token="s3cret"))
    reply = await surplus.recv()
    assert isinstance(reply, Reject) and "surplus" in reply.reason
    assert not task.done()
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_bad_frames_get_a_clear_reply(ctx):
    coordinator, task = await serve(ctx)
    peer = FakeWorker(ctx, coordinator.endpoint, "peer")
    await peer.sock.send(msgpack.packb({"v": 99, "t": "hello"}))
    reply = await peer.recv()
    assert isinstance(reply, Reject) and "protocol version 99" in reply.reason
    await peer.sock.send(b"\xc1 not msgpack")
    reply = await peer.recv()
    assert isinstance(reply, Reject) and "malformed message" in reply.reason
    await peer.send(EpochReady(epoch=0, train_batches=1, valid_batches=None))
    reply = await peer.recv()
    assert isinstance(reply, Reject) and "send hello first" in reply.reason
    assert coordinator.dropped_frames == 2  # the foreign version and the junk
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_differing_models_abort_the_run_naming_the_parameter(ctx):
    """The hellos carry digests only; the coordinator asks both workers for their entries (a
    page each here) and names the first that differs."""
    coordinator, task = await serve(ctx)
    a = FakeWorker(ctx, coordinator.endpoint, "a")
    b = FakeWorker(ctx, coordinator.endpoint, "b", params=OTHER_PARAMS)
    await a.send(hello("a"))
    assert isinstance(await a.recv(), Joined)
    await b.send(hello("b", fingerprint=OTHER_FP))
    for w, abort in zip((a, b), await asyncio.gather(a.recv(), b.recv()), strict=True):
        assert isinstance(abort, Abort)
        assert "parameter 'w' has shape (2, 3) in worker a" in abort.reason
        assert "(3, 3) in worker b" in abort.reason
        assert w.asked == [0]
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_a_hello_with_a_huge_fingerprint_and_no_token_builds_no_parameter(ctx, monkeypatch):
    """A stranger's hello with a wrong token and as many fingerprint entries as fit in a frame is
    refused without an entry being built, and without costing the run its clock."""
    built = records_built(monkeypatch, ParamSpec)
    lines: list[str] = []
    cfg = CoordinatorConfig(world_size=2, epochs=2, token="s3cret")
    coordinator = Coordinator(cfg, context=ctx, log=lines.append)
    await coordinator.start()
    task = asyncio.create_task(coordinator.run())
    entry = {"name": "layer.0.weight", "shape": [512, 512, 3, 3], "dtype": "float32"}
    entries = min((MAX_FRAME_BYTES - 1024) // len(msgpack.packb(entry)), MAX_PARAMS)
    frame = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "t": "hello",
            **{
                k: v
                for k, v in msgpack.unpackb(encode(hello("x", token="guess"))).items()
                if k not in ("v", "t", "fingerprint")
            },
            "fingerprint": {"digest": "d" * 64, "params": [entry] * entries, "torch_version": "x"},
        }
    )
    assert len(frame) <= MAX_FRAME_BYTES
    for i in range(4):
        stranger = FakeWorker(ctx, coordinator.endpoint, f"stranger{i}")
        await stranger.sock.send(frame)
        reply = await stranger.recv()
        assert isinstance(reply, Reject), reply
    assert built == []
    # a legitimate worker still joins at once
    w = FakeWorker(ctx, coordinator.endpoint, "legit")
    await w.send(hello("legit", token="s3cret"))
    assert isinstance(await w.recv(), Joined)
    assert not any("was not running" in line for line in lines), lines
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_a_frame_over_the_limit_is_never_read(ctx):
    """libzmq drops the connection of a peer announcing a frame over MAX_FRAME_BYTES before the
    coordinator holds it: no reply, nothing counted, and the run carries on."""
    coordinator, task = await serve(ctx)
    big = FakeWorker(ctx, coordinator.endpoint, "big")
    await big.sock.send(b"\x81" + b"\xa1" + b"x" * (MAX_FRAME_BYTES + 1))
    legit = FakeWorker(ctx, coordinator.endpoint, "legit")
    await legit.send(hello("legit"))
    assert isinstance(await legit.recv(), Joined)
    with pytest.raises(TimeoutError):
        await big.recv(timeout=0.5)
    assert (coordinator.dropped_frames, coordinator.ignored_frames) == (0, 0)
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_a_failed_rank_aborts_the_others(ctx):
    coordinator, task = await serve(ctx)
    workers = await join_all(ctx, coordinator, 2)
    await workers[1].send(Failed(reason="CUDA out of memory"))
    abort = await workers[0].recv()
    assert isinstance(abort, Abort)
    assert "rank 1 (worker w1 (host testhost, pid 1)) failed: CUDA out of memory" in abort.reason
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_a_stranger_sending_junk_gets_a_few_answers_then_silence(ctx):
    from epochal.coordinator.rules.strangers import STRANGER_REPLIES

    coordinator, task = await serve(ctx)
    peer = FakeWorker(ctx, coordinator.endpoint, "noisy")
    for _ in range(STRANGER_REPLIES + 12):
        await peer.sock.send(b"\x93junk")
    for _ in range(STRANGER_REPLIES):
        reply = await peer.recv()
        assert isinstance(reply, Reject) and reply.code == "malformed"

    # every frame past the budget is counted as ignored, and an ignored frame gets no answer
    async def all_handled() -> None:
        while coordinator.ignored_frames < 12:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(all_handled(), 5)
    assert coordinator.ignored_frames == 12
    # past its budget a stranger's frames are not even decoded
    assert coordinator.dropped_frames == STRANGER_REPLIES
    # the run itself is untouched: a worker can still join
    w = FakeWorker(ctx, coordinator.endpoint, "legit")
    await w.send(hello("legit"))
    assert isinstance(await w.recv(), Joined)
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 5)


async def test_a_finished_runs_summary_carries_the_history_of_its_journal(ctx, tmp_path):
    config = CoordinatorConfig(world_size=2, epochs=2, run_dir=tmp_path / "run")
    coordinator = Coordinator(config, context=ctx, log=lambda line: None)
    await coordinator.start()
    task = asyncio.create_task(coordinator.run())
    workers = await join_all(ctx, coordinator, 2)
    for w in workers:
        await w.send(EpochReady(epoch=0, train_batches=1, valid_batches=None))
    for w in workers:
        assert isinstance(await w.recv(), Go)
    for epoch in range(2):
        ready = EpochReady(1, 1, None) if epoch == 0 else None
        for w in workers:
            await w.send(EpochReport(epoch, 2.0 - epoch, 1, 0.0, 0, ready=ready))
        for w in workers:
            assert isinstance(await w.recv(), Decision)
    for w in workers:
        assert isinstance(await w.recv(), Finish)
        await w.send(Done())
    summary = await asyncio.wait_for(task, 5)
    assert [o.epoch for o in summary.history] == [0, 1]

    lines: list[str] = []
    again = Coordinator(config, context=ctx, log=lines.append)
    assert again.finished is None  # nothing is read before start()
    await again.start()
    assert again.finished is not None
    done = await asyncio.wait_for(again.run(), 5)
    assert "already finished" in lines[-1]
    assert (done.run_id, done.best_epoch, done.epochs_run) == (coordinator.run_id, 1, 2)
    assert done.history == summary.history


async def test_fresh_deletes_the_run_directory_when_started_not_when_made(ctx, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "result.json").write_text('{"status": "finished"}')
    config = CoordinatorConfig(world_size=2, epochs=2, run_dir=run_dir)
    coordinator = Coordinator(config, context=ctx, log=lambda line: None, fresh=True)
    assert (run_dir / "result.json").exists()
    await coordinator.start()
    assert not (run_dir / "result.json").exists()
    assert coordinator.finished is None
    coordinator.abort("test over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(coordinator.run(), 5)
