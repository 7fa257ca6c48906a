"""A coordinator and workers one minor protocol version apart run a whole run together, and an
optional message type reaches only a peer that said it understands it.

The real in-process Coordinator, over real ZeroMQ sockets as test_service.py drives it, with two
workers: a scripted DEALER that speaks the next minor version (every frame carries
``m = PROTOCOL_MINOR + 1`` and a field this version does not know, in the frame and in every record
inside it), and a real ControlClient on its own thread, hearing from a coordinator whose every
frame is made the next minor's the same way. Each side skips what it does not know and logs each
unknown field once, however many frames carried it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
from typing import Any

import pytest
import zmq.asyncio

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.coordinator.rules import joining
from epochal.coordinator.rules.actions import Broadcast, Send
from epochal.coordinator.serve import service as coordinator_service
from epochal.protocol import (
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    TYPE_NAMES,
    Abort,
    CoordinatorMessage,
    Decision,
    Done,
    EpochReady,
    EpochReport,
    Finish,
    Go,
    Hello,
    Joined,
    Message,
    OpenStore,
    StoreReady,
    Text,
    Welcome,
    WorkerMessage,
    message,
    understood,
)
from epochal.protocol.registry import fields_of
from epochal.worker.control.client import ControlClient
from epochal.worker.joinoptions import JoinOptions
from tests.conftest import hello
from tests.coordinator.test_service import FakeWorker
from tests.protocol.test_versions import newer

EPOCHS = 2
CONFIG = CoordinatorConfig(world_size=2, epochs=EPOCHS, heartbeat_interval=0.2)
WAIT = CONFIG.heartbeat_timeout
"""Seconds any one answer may take: a coordinator silent for longer would abort the run."""

SKIPPED = re.compile(r"skipped field '([^']*)' of a frame from a peer of protocol version (\S+):")


class NewerWorker(FakeWorker):
    """A scripted worker of the next minor version; counts the unknown fields it sent."""

    sent: collections.Counter[str]

    async def send(self, message: Message) -> None:
        session = "" if isinstance(message, Hello) else self.session
        data, added = newer(message, session)
        self.sent.update(added)
        await self.sock.send(data)


async def newer_worker(worker: NewerWorker) -> list[Message]:
    """Rank 0's whole run: it opens the store; returns what it heard."""
    heard: list[Message] = []

    async def answer(*kinds: type) -> Any:
        message = await worker.recv(timeout=WAIT)
        assert isinstance(message, kinds), message
        heard.append(message)
        return message

    await worker.send(hello(worker.worker_id, rank_hint=0, understands=("from_the_future",)))
    await answer(Joined)
    await answer(OpenStore)
    await worker.send(StoreReady(host="127.0.0.1", port=4242, key="s3cret"))
    await answer(Welcome)
    await worker.send(EpochReady(epoch=0, train_batches=5, valid_batches=2))
    await answer(Go)
    for epoch in range(EPOCHS):
        ready = EpochReady(epoch + 1, 5, 2) if epoch + 1 < EPOCHS else None
        await worker.send(
            EpochReport(
                epoch=epoch,
                train_loss_sum=2.0,
                train_count=2,
                valid_loss_sum=1.0,
                valid_count=2,
                ready=ready,
            )
        )
        await answer(Decision)
    await answer(Finish)
    await worker.send(Done())
    return heard


def real_client(client: ControlClient, note: Message | None = None) -> list[Message]:
    """Rank 1's whole run through the real client, on this thread; returns what it heard. Once
    welcomed it tries to send ``note`` (an optional type the coordinator may not understand) in
    each epoch."""
    heard: list[Message] = []

    def answer(*kinds: type) -> Any:
        message = client.receive(timeout=WAIT)
        assert isinstance(message, kinds), message
        heard.append(message)
        return message

    client.send(hello("real", rank_hint=1, understands=understood()))
    answer(Joined)
    answer(Welcome)
    client.send(EpochReady(epoch=0, train_batches=5, valid_batches=2))
    answer(Go)
    for epoch in range(EPOCHS):
        if note is not None:
            client.send(note)  # type: ignore[arg-type]
        ready = EpochReady(epoch + 1, 5, 2) if epoch + 1 < EPOCHS else None
        client.send(
            EpochReport(
                epoch=epoch,
                train_loss_sum=4.0,
                train_count=2,
                valid_loss_sum=3.0,
                valid_count=2,
                ready=ready,
            )
        )
        answer(Decision)
    answer(Finish)
    client.send(Done())
    client.close()
    return heard


def told(lines: list[str]) -> collections.Counter[str]:
    """How many times each skipped field was logged, checking the versions the lines name."""
    found: collections.Counter[str] = collections.Counter()
    for line in lines:
        match = SKIPPED.search(line)
        if match:
            assert match[2] == f"{PROTOCOL_VERSION}.{PROTOCOL_MINOR + 1}", line
            found[match[1]] += 1
    return found


async def test_a_whole_run_with_workers_and_a_coordinator_one_minor_version_apart(
    ctx: zmq.asyncio.Context,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    optional_types: tuple[type, type],
):
    # the coordinator is the older side for optional types: it understands none; the newer
    # worker's hello lists one this coordinator has never heard of
    monkeypatch.setattr(joining, "understood", lambda: ())
    _, note_type = optional_types
    # the coordinator's frames are made the next minor's: the client hears a newer coordinator
    carried: collections.Counter[str] = collections.Counter()

    def newer_encode(message: Message, session: str = "") -> bytes:
        data, added = newer(message, session)
        carried.update(added)
        return data

    monkeypatch.setattr(coordinator_service, "encode", newer_encode)
    lines: list[str] = []
    coordinator = Coordinator(CONFIG, context=ctx, log=lines.append)
    endpoint = await coordinator.start()
    run = asyncio.create_task(coordinator.run())

    worker = NewerWorker(ctx, endpoint, "newer")
    worker.sent = collections.Counter()
    client = ControlClient(endpoint, b"real", JoinOptions(abort_grace=600.0, reattach_timeout=0))
    client.start()  # configures epochal's logging, whose records then stop at "epochal"
    monkeypatch.setattr(logging.getLogger("epochal"), "propagate", True)
    with caplog.at_level(logging.INFO, logger="epochal.worker"):
        try:
            heard_newer, heard_real = await asyncio.gather(
                newer_worker(worker),
                asyncio.to_thread(real_client, client, note_type(text="a newer worker's note")),
            )
            summary = await asyncio.wait_for(run, WAIT)
        finally:
            client.close(flush=0.1)
            run.cancel()

    # the run went through: both workers heard the same decisions, and the run finished
    assert summary.epochs_run == EPOCHS
    decisions = [m for m in heard_real if isinstance(m, Decision)]
    assert decisions == [m for m in heard_newer if isinstance(m, Decision)]
    assert [d.stop for d in decisions] == [False, True] and decisions[0].go is not None

    # the coordinator skipped every field the newer worker made up, and said so once each,
    # although most were in several frames (each epoch's report, every record of a hello)
    assert told(lines) == dict.fromkeys(worker.sent, 1)
    assert worker.sent["epoch_report.later"] == EPOCHS
    assert {"hello.fingerprint.later", "epoch_report.ready.later"} <= set(worker.sent)

    # the real client skipped those of the newer coordinator's frames, once each
    said = told([r.getMessage() for r in caplog.records if r.name == "epochal.worker"])
    heard = {f"{TYPE_NAMES[type(m)]}.later" for m in heard_real} | {"decision.go.later"}
    assert heard <= set(said) <= set(carried)
    assert set(said.values()) == {1}
    assert carried["decision.later"] >= EPOCHS  # sent to each worker in each epoch

    # the optional note the coordinator's welcome did not list was never sent: said once
    assert client.understands == frozenset()
    held = [r.getMessage() for r in caplog.records if "does not understand note" in r.getMessage()]
    assert len(held) == 1, held
    assert not any("malformed" in line or "unknown message type" in line for line in lines)


@pytest.fixture
def optional_types(registry: None) -> tuple[type, type]:
    """Two optional message types, one each way, as a newer minor version might add them;
    forgotten after the test."""

    @message
    class Hint(CoordinatorMessage):
        optional = True
        text: Text

    @message
    class Note(WorkerMessage):
        optional = True
        text: Text

    return Hint, Note


async def heard_within(worker: FakeWorker, seconds: float) -> list[Message]:
    """What ``worker`` heard besides heartbeats in the next ``seconds``."""
    heard: list[Message] = []

    async def listen() -> None:
        while True:
            heard.append(await worker.recv(timeout=seconds))

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(listen(), seconds)
    return heard


async def test_an_optional_message_reaches_only_the_workers_that_understand_it(
    ctx: zmq.asyncio.Context, optional_types: tuple[type, type]
):
    hint_type, _ = optional_types
    lines: list[str] = []
    coordinator = Coordinator(CONFIG, context=ctx, log=lines.append)
    endpoint = await coordinator.start()
    run = asyncio.create_task(coordinator.run())
    newer, older = FakeWorker(ctx, endpoint, "newer"), FakeWorker(ctx, endpoint, "older")
    try:
        await newer.send(hello("newer", rank_hint=0, understands=("hint",)))
        await older.send(hello("older", rank_hint=1))  # an older worker: it lists none
        assert isinstance(await newer.recv(timeout=WAIT), Joined)
        assert isinstance(await older.recv(timeout=WAIT), Joined)
        hint = hint_type(text="from a newer coordinator")
        peers = (newer.worker_id.encode(), older.worker_id.encode())
        await coordinator._carry_out([Broadcast(peers, hint), Send(peers[1], hint)])
        await coordinator._carry_out([Send(peers[0], Abort(reason="test over"))])
        heard = [await newer.recv(timeout=WAIT)]
        while not isinstance(heard[-1], Abort):  # rank 0 is asked to open the store first
            heard.append(await newer.recv(timeout=WAIT))
        assert heard.count(hint) == 1
        # neither the broadcast nor the send reached it (its heartbeats do, every 0.2 s)
        assert await heard_within(older, 1.0) == []
    finally:
        run.cancel()
    held = [line for line in lines if "does not understand hint" in line]
    assert len(held) == 1, lines  # said once, although two were held back


def test_the_welcome_and_the_hello_list_the_optional_types_this_version_understands(
    optional_types: tuple[type, type],
):
    assert understood() == ("hint", "note")
    for cls in (Hello, Welcome):
        spec = next(s for s in fields_of(cls) if s.name == "understands")
        assert not spec.required and spec.default == ()  # an older peer's frame: it lists none
