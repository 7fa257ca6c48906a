"""What a member writes reaches the coordinator's log as one escaped, bounded line.

An admitted worker (it holds the token) chooses its host, its data-plane address, its worker id,
the host rank 0 reports for the store and every ``Failed`` reason. Each test runs a real
coordinator over real ZeroMQ sockets, with workers played by DEALER sockets, and reads every line
the service logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import zmq
import zmq.asyncio

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.models import describe_difference, describe_fingerprints
from epochal.coordinator.rules.rendezvous import Admitted, Fatal, Refused, Rendezvous, models_differ
from epochal.coordinator.rules.watchdog import FAILURE_SETTLE, FAILURES_KEPT
from epochal.coordinator.serve.resume import inspect
from epochal.errors import RunAborted
from epochal.protocol import (
    Abort,
    Failed,
    Fingerprint,
    Heartbeat,
    Hello,
    Joined,
    Message,
    OpenStore,
    ParamSpec,
    StoreReady,
    Welcome,
    decode,
    encode,
)
from epochal.protocol.limits import MAX_NAME_CHARS, MAX_TEXT_CHARS
from epochal.text import REASON_CHARS
from tests.conftest import hello

FORGED_LINE = "x\n[epochal] run r1 finished after 3 epochs: best epoch 2\x1b[2J"
FORGED = FORGED_LINE + "A" * (MAX_TEXT_CHARS - len(FORGED_LINE))
"""A forged log line, a terminal escape that clears the screen, and as many characters as a
reason may carry."""
FORGED_NAME = FORGED[:MAX_NAME_CHARS]
"""The same as long as a name (a host, an address, an id) may be."""

LINE_CHARS = 8 * REASON_CHARS
"""Longest line a member's strings may make: a few bounded fields, each escape at most 4 chars."""

FP = Fingerprint(digest="a" * 64, torch_version="x", entries=1)


class Worker:
    """A DEALER socket speaking the protocol as a worker would."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, identity: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.session = ""

    async def send(self, message: Message) -> None:
        session = "" if isinstance(message, Hello) else self.session
        await self.sock.send(encode(message, session=session))

    async def recv(self) -> Message:
        while True:
            message = decode(await asyncio.wait_for(self.sock.recv(), 10))
            if isinstance(message, Joined | Welcome):
                self.session = message.session
            if not isinstance(message, Heartbeat):
                return message


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def assert_one_line_each(lines: list[str]) -> None:
    assert lines, "nothing was logged: the check would see nothing"
    for line in lines:
        assert line.isprintable(), f"a control character reached the log: {line[:120]!r}"
        assert len(line) <= LINE_CHARS, f"a line of {len(line)} characters: {line[:120]!r}"


async def test_a_members_host_address_id_store_host_and_reason_are_logged_escaped_and_bounded(
    ctx: zmq.asyncio.Context,
):
    lines: list[str] = []
    coordinator = Coordinator(
        CoordinatorConfig(world_size=2, epochs=2), context=ctx, log=lines.append
    )
    await coordinator.start()
    task = asyncio.create_task(coordinator.run())
    evil = Worker(ctx, coordinator.endpoint, b"w0")
    other = Worker(ctx, coordinator.endpoint, b"w1")
    await evil.send(hello(FORGED_NAME, host=FORGED_NAME, data_address=FORGED_NAME))
    assert isinstance(await evil.recv(), Joined)
    await other.send(hello("w1"))
    assert isinstance(await other.recv(), Joined)
    opener, second = (evil, other) if isinstance(await evil.recv(), OpenStore) else (other, evil)
    await opener.send(StoreReady(host=FORGED_NAME, port=4242, key="k"))
    for worker in (evil, other):
        assert isinstance(await worker.recv(), Welcome)
    await evil.send(Failed(reason=FORGED))
    abort = await second.recv()
    assert isinstance(abort, Abort)
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 10)
    assert_one_line_each(lines)
    shown = "x\\n[epochal] run r1 finished after 3 epochs: best epoch 2\\x1b[2J"
    said = "\n".join(lines)
    assert f"failed: {shown}" in said  # the reason, escaped
    assert f"worker {shown}" in said and f"host {shown}" in said  # hello's id and host
    assert f"data plane at {shown}" in said  # hello's data address, in the placement lines
    assert f"data-plane store at {shown}" in said  # rank 0's store host
    assert abort.reason.isprintable() and len(abort.reason) <= LINE_CHARS


async def test_a_member_failing_before_the_run_started_is_logged_escaped_and_bounded(
    ctx: zmq.asyncio.Context,
):
    lines: list[str] = []
    coordinator = Coordinator(
        CoordinatorConfig(world_size=2, epochs=2), context=ctx, log=lines.append
    )
    await coordinator.start()
    task = asyncio.create_task(coordinator.run())
    worker = Worker(ctx, coordinator.endpoint, b"w0")
    await worker.send(hello("w0", host=FORGED_NAME))
    assert isinstance(await worker.recv(), Joined)
    await worker.send(Failed(reason=FORGED))
    deadline = asyncio.get_running_loop().time() + 10
    while not any("failed before the run started" in line for line in lines):
        assert asyncio.get_running_loop().time() < deadline, lines
        await asyncio.sleep(0.05)
    coordinator.abort("the test is over")
    with pytest.raises(RunAborted):
        await asyncio.wait_for(task, 10)
    assert_one_line_each(lines)


def test_a_flood_of_failures_from_one_member_makes_one_bounded_abort():
    # every Failed frame used to add a line to the abort reason: thousands of 64 KiB reasons
    config = CoordinatorConfig(world_size=2, epochs=2)
    machine = RunMachine(config, inspect(config, None), run_id="r1", now=0.0)
    sessions = {}
    for peer in (b"w0", b"w1"):
        for action in machine.on_message(0.0, peer, hello(peer.decode())):
            message = getattr(action, "message", None)
            if isinstance(message, Joined):
                sessions[peer] = message.session
    opener = b"w0" if machine.members[0].peer == b"w0" else b"w1"
    machine.on_message(0.0, opener, StoreReady(host="h", port=1, key="k"), session=sessions[opener])
    for _ in range(1000):
        machine.on_message(0.1, b"w1", Failed(reason=FORGED), session=sessions[b"w1"])
    actions = machine.on_tick(0.1 + FAILURE_SETTLE)
    (abort,) = [a.message for a in actions if isinstance(getattr(a, "message", None), Abort)]
    assert abort.reason.count("failed: ") == FAILURES_KEPT
    assert abort.reason.endswith(f"and {1000 - FAILURES_KEPT} more failures reported")
    assert abort.reason.isprintable() and len(abort.reason) <= FAILURES_KEPT * LINE_CHARS


def test_what_a_refusal_or_a_model_difference_quotes_from_a_hello_is_escaped_and_bounded():
    # a stranger chooses its job name; a member its worker id and its model's entries
    config = CoordinatorConfig(world_size=3, epochs=2)
    rendezvous = Rendezvous(config)
    assert isinstance(rendezvous.offer(b"a", hello(FORGED_NAME)), Admitted)
    verdicts = [
        rendezvous.offer(b"b", replace(hello("b"), job=FORGED_NAME)),
        rendezvous.offer(b"c", hello(FORGED_NAME)),  # a duplicate id
        rendezvous.offer(b"a", hello("another id")),  # its connection already joined
    ]
    reasons = [v.reason for v in verdicts if isinstance(v, Refused | Fatal)]
    assert len(reasons) == len(verdicts)
    own = [ParamSpec("w", (2,), "float32")]
    differences = [
        describe_difference([ParamSpec(FORGED_NAME, (2,), "float32")], own, "a", "b"),
        describe_difference(own, [ParamSpec("w", (2,), FORGED_NAME)], "a", "b"),  # its dtype
        describe_difference(own, [*own, ParamSpec(FORGED_NAME, (), "f")], "a", "b"),
        describe_fingerprints(FP, replace(FP, torch_version=FORGED_NAME), "a", "b"),
    ]
    reasons += [models_differ(d) for d in differences]
    assert_one_line_each(reasons)
    missing = [r[:100] for r in reasons if "x\\n[epochal] run r1" not in r]
    assert not missing, missing
