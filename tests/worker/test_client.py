"""The control client's own failures reach the training code and the coordinator, with their cause.

A fake coordinator (a ROUTER socket on a random loopback port) stands in for the service, so
each test sees exactly the frames the client sends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from epochal.errors import ConfigError, CoordinatorLost, EpochalError, RunAborted
from epochal.protocol import (
    Abort,
    Awaiting,
    DescribeModel,
    Failed,
    Joined,
    Liveness,
    ModelPage,
    ParamSpec,
    Phase,
    Status,
    decode,
    encode,
)
from epochal.protocol.limits import MAX_TEXT_CHARS
from epochal.security.curvekeys import ClientSecurity
from epochal.worker.control import dealer
from epochal.worker.control.client import ABORT_CHARS, ControlClient
from epochal.worker.control.heartbeats import beat_due
from epochal.worker.control.progress import BUSY_STEP, CpuProgress, process_cpu, thread_cpu
from epochal.worker.joinoptions import JoinOptions
from tests.waiting import wait_until

HEARTBEAT_INTERVAL = 0.2
MARGIN = 10.0
"""Seconds added to a configured interval for a loaded machine to act on it."""


@pytest.fixture
def router() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture
def client(router: tuple[zmq.Socket[bytes], str]) -> Iterator[ControlClient]:
    _, endpoint = router
    control = ControlClient(
        endpoint,
        b"worker-under-test",
        JoinOptions(abort_grace=600.0),  # the test takes the abort itself: never end the process
        liveness=Liveness(interval=HEARTBEAT_INTERVAL),
    )
    control.start()
    try:
        yield control
    finally:
        control.close(flush=0.1)


def frames_until(sock: zmq.Socket[bytes], deadline: float, want: type) -> list[object]:
    """Every message received until one of type ``want`` arrives (or the deadline passes)."""
    seen: list[object] = []
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if sock.poll(100):
            _, data = sock.recv_multipart()
            seen.append(decode(data))
            if isinstance(seen[-1], want):
                return seen
    return seen


def test_a_misspelt_phase_is_refused_at_the_call(client: ControlClient):
    with pytest.raises(ValueError, match=r"phase must be one of .*got 'trian'"):
        client.at("trian", 1)  # type: ignore[arg-type]
    client.at(Phase.TRAIN, 1)
    assert client.phase is Phase.TRAIN
    client.check()  # nothing failed


def test_a_wait_says_what_it_waits_for_and_only_a_wait_does(client: ControlClient):
    with pytest.raises(ValueError, match="awaiting is given exactly when the phase is waiting"):
        client.at(Phase.WAITING, 1)
    with pytest.raises(ValueError, match="awaiting is given exactly when the phase is waiting"):
        client.at(Phase.TRAIN, 1, Awaiting.GO)
    client.at(Phase.WAITING, 1, Awaiting.DECISION)
    assert (client.phase, client.awaiting) == (Phase.WAITING, Awaiting.DECISION)


def first_status(sock: zmq.Socket[bytes], phase: Phase, epoch: int) -> Status | None:
    """The first heartbeat in ``phase`` of ``epoch`` (None if none within the bound)."""
    end = time.monotonic() + HEARTBEAT_INTERVAL + MARGIN
    while time.monotonic() < end:
        for seen in frames_until(sock, end - time.monotonic(), Status):
            if isinstance(seen, Status) and (seen.phase, seen.epoch) == (phase, epoch):
                return seen
    return None


def test_the_heartbeat_carries_the_answer_awaited(
    client: ControlClient, router: tuple[zmq.Socket[bytes], str]
):
    sock, _ = router
    client.at(Phase.WAITING, 1, Awaiting.GO)
    beat = first_status(sock, Phase.WAITING, 1)
    assert beat is not None and beat.awaiting is Awaiting.GO
    client.at(Phase.WAITING, 2, Awaiting.DECISION)
    beat = first_status(sock, Phase.WAITING, 2)
    assert beat is not None and beat.awaiting is Awaiting.DECISION
    client.at(Phase.TRAIN, 3)
    beat = first_status(sock, Phase.TRAIN, 3)
    assert beat is not None and beat.awaiting is None


def test_a_heartbeat_is_due_an_interval_after_the_last_frame_sent_whatever_it_was():
    # a worker that sent its loss report half an interval ago owes no heartbeat yet: the report
    # said it lives; one silent for an interval does
    assert beat_due(10.0, sent_at=9.5, interval=1.0) == 10.5
    assert beat_due(10.0, sent_at=9.0, interval=1.0) is None
    assert beat_due(10.0, sent_at=2.0, interval=1.0) is None
    # a frame sent every half interval keeps the heartbeat from ever falling due
    sent, beats = 0.0, 0
    for tick in range(1, 40):
        now = tick * 0.25
        if tick % 2 == 0:
            sent = now
        if beat_due(now, sent, 1.0) is None:
            beats += 1
    assert beats == 0


def test_an_idle_client_keeps_sending_heartbeats_every_interval(
    client: ControlClient, router: tuple[zmq.Socket[bytes], str]
):
    sock, _ = router
    client.at(Phase.TRAIN, 4)
    beats = 0
    for _ in range(3):  # each one an interval after the one before: nothing else is sent
        beat = first_status(sock, Phase.TRAIN, 4)
        assert beat is not None, "an idle client stopped sending heartbeats"
        beats += 1
    assert beats == 3


def test_a_dead_heartbeat_task_fails_the_worker_at_once_naming_its_cause(
    client: ControlClient, router: tuple[zmq.Socket[bytes], str]
):
    sock, _ = router
    beats = frames_until(sock, HEARTBEAT_INTERVAL + MARGIN, Status)
    assert beats and isinstance(beats[-1], Status), "the client sent no heartbeat"
    client.phase = "trian"  # type: ignore[assignment]  # past at(): the heartbeat task dies

    seen = frames_until(sock, HEARTBEAT_INTERVAL + MARGIN, Failed)
    failed = seen[-1] if seen else None
    assert isinstance(failed, Failed), f"the coordinator was not told; it got {seen}"
    assert "stopped sending heartbeats" in failed.reason
    assert "ValueError" in failed.reason and "'trian'" in failed.reason
    with pytest.raises(RunAborted, match=r"stopped sending heartbeats.*'trian'"):
        client.check()


FORGED_LINE = "x\n[epochal] run r1 finished after 3 epochs: best epoch 2\x1b[2J"
FORGED = FORGED_LINE + "A" * (MAX_TEXT_CHARS - len(FORGED_LINE))
"""A reason another process wrote: a forged log line, a terminal escape, and as many characters
as a reason may carry."""


def test_an_abort_reason_is_shown_on_one_line_escaped_and_bounded(
    client: ControlClient, router: tuple[zmq.Socket[bytes], str]
):
    # every rank prints the coordinator's reason; a coordinator is trusted less than the user
    sock, _ = router
    end = time.monotonic() + HEARTBEAT_INTERVAL + MARGIN
    while not sock.poll(100):
        assert time.monotonic() < end, "the client sent no heartbeat"
    identity, _ = sock.recv_multipart()
    sock.send_multipart([identity, encode(Abort(reason=FORGED))])
    with pytest.raises(RunAborted) as info:
        client.receive(timeout=MARGIN)
    shown = str(info.value)
    # at most ABORT_CHARS characters of the reason, each shown as at most 4 ("\\x1b"), then "..."
    assert shown.isprintable() and shown.endswith("...") and len(shown) <= 4 * ABORT_CHARS + 3
    assert shown.startswith("x\\n[epochal] run r1 finished after 3 epochs: best epoch 2\\x1b[2J")
    with pytest.raises(RunAborted) as again:
        client.check()
    assert str(again.value) == shown


def test_the_models_entries_are_sent_a_page_at_a_time_when_the_coordinator_asks(
    client: ControlClient, router: tuple[zmq.Socket[bytes], str]
):
    """The client answers DescribeModel from its own thread: the training code does nothing."""
    sock, _ = router
    client.model_params = tuple(
        ParamSpec(f"layers.{i}.weight", (4096, 4096), "bfloat16") for i in range(3000)
    )
    end = time.monotonic() + HEARTBEAT_INTERVAL + MARGIN
    while not sock.poll(100):  # a heartbeat tells the fake coordinator the client's identity
        assert time.monotonic() < end, "the client sent nothing"
    peer, _ = sock.recv_multipart()
    received: list[ParamSpec] = []
    while len(received) < len(client.model_params):
        sock.send_multipart([peer, encode(DescribeModel(first=len(received)))])
        pages = [m for m in frames_until(sock, MARGIN, ModelPage) if isinstance(m, ModelPage)]
        assert pages, "no page came"
        assert pages[-1].first == len(received) and pages[-1].entries == 3000
        received.extend(pages[-1].params)
    assert tuple(received) == client.model_params


def test_the_client_takes_the_runs_heartbeats_from_its_joined(
    client: ControlClient, router: tuple[zmq.Socket[bytes], str]
):
    """One source per setting: the run's heartbeat timeout, not a default of the worker's, decides
    when this worker takes its coordinator for lost."""
    sock, _ = router
    end = time.monotonic() + HEARTBEAT_INTERVAL + MARGIN
    while not sock.poll(100):  # a heartbeat tells the fake coordinator the client's identity
        assert time.monotonic() < end, "the client sent nothing"
    peer, _ = sock.recv_multipart()
    run = Liveness(interval=0.05, timeout=1.0)  # the default timeout is 15 s
    sock.send_multipart(
        [peer, encode(Joined(joined=1, world_size=2, session="s" * 43, liveness=run))]
    )
    assert isinstance(client.receive(timeout=MARGIN), Joined)
    assert client.liveness == run
    client.watch_coordinator()
    with pytest.raises(CoordinatorLost, match="sent nothing for 1 s"):
        client.receive(timeout=run.timeout + MARGIN)


def test_a_loop_of_its_own_shows_progress_by_its_cpu_and_only_while_it_uses_some(
    client: ControlClient, router: tuple[zmq.Socket[bytes], str]
):
    # a session opened for the rendezvous only, or a torchrun script: nobody reports steps, so
    # the heartbeats count one whenever the watched CPU time grew (the coordinator's stall
    # report and --stall-abort would otherwise take a long loop of the script's own for a hang)
    sock, _ = router
    used = [0.0]
    client.busy = CpuProgress(lambda: used[0])
    client.at(Phase.TRAIN, 0)
    still = first_status(sock, Phase.TRAIN, 0)
    assert still is not None
    frames_until(sock, 3 * HEARTBEAT_INTERVAL, Failed)  # a few heartbeats with no CPU used
    idle = [s for s in frames_until(sock, 3 * HEARTBEAT_INTERVAL, Failed) if isinstance(s, Status)]
    assert idle and {s.step for s in idle} == {still.step}, idle  # no CPU: no progress

    used[0] = BUSY_STEP / 2  # less than a step's worth
    later = [s for s in frames_until(sock, 3 * HEARTBEAT_INTERVAL, Failed) if isinstance(s, Status)]
    assert later and {s.step for s in later} == {still.step}, later
    used[0] = 1.0
    moved = [s for s in frames_until(sock, 3 * HEARTBEAT_INTERVAL, Failed) if isinstance(s, Status)]
    assert moved and moved[-1].step == still.step + 1, moved


def test_thread_cpu_and_process_cpu_grow_with_work_only():
    import subprocess
    import sys
    import threading

    clock = thread_cpu(threading.get_ident())
    before = clock()
    end = time.monotonic() + 30.0  # a loaded machine gives this thread its share, slowly
    while clock() - before < BUSY_STEP and time.monotonic() < end:
        pass
    assert clock() - before >= BUSY_STEP
    before = clock()
    time.sleep(0.2)
    assert clock() - before < BUSY_STEP

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(1.0)  # both interpreters started
        first = process_cpu(spinner.pid), process_cpu(sleeper.pid)
        wait_until(
            lambda: process_cpu(spinner.pid) - first[0] >= BUSY_STEP,
            30.0,
            f"the spinning interpreter used less than {BUSY_STEP} s of CPU",
        )
        assert process_cpu(sleeper.pid) - first[1] < BUSY_STEP
    finally:
        spinner.kill()
        sleeper.kill()
        spinner.wait()
        sleeper.wait()


FLUSH = 60.0
"""The flush a finished close is given below: one that waited it out would take a minute."""
SHORT_FLUSH = 1.0
"""The flush an unfinished close is given below, which it waits out (nobody takes its frames)."""


@pytest.mark.parametrize("finished", [True, False], ids=["finished", "not-finished"])
def test_a_finished_worker_whose_coordinator_has_gone_closes_without_waiting_out_the_flush(
    router: tuple[zmq.Socket[bytes], str], client: ControlClient, finished: bool
):
    """Once the run is over and the coordinator has closed the connection, the heartbeats queued
    meanwhile have nobody to go to: closing drops them at once. Not finished (a last Failed may
    be queued), closing still tries to send what is queued for the flush."""
    sock, _ = router
    assert any(isinstance(m, Status) for m in frames_until(sock, MARGIN, Status))
    sock.close(linger=0)  # the coordinator ends
    # its disconnect seen by the client
    wait_until(lambda: not client._up, MARGIN, "the client never saw the disconnect", 0.02)
    time.sleep(3 * HEARTBEAT_INTERVAL)  # heartbeats queued for nobody
    closing = time.monotonic()
    client.close(flush=FLUSH if finished else SHORT_FLUSH, finished=finished)
    took = time.monotonic() - closing
    assert client._thread is not None and not client._thread.is_alive()
    if finished:
        assert took < FLUSH, took
    else:  # what is queued is tried for the whole flush (linger): a lower bound holds
        assert took >= SHORT_FLUSH * 0.9, took


def test_a_connection_that_fails_to_set_up_leaves_no_socket_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DEALER whose setup fails (a CURVE key libzmq refuses, no descriptor left for its
    monitor) is closed with its context at once, and the client says why it could not start:
    left open, the garbage collector found it later, in whichever test it then ran."""
    contexts: list[zmq.asyncio.Context] = []

    class Kept(zmq.asyncio.Context):
        def __init__(self) -> None:
            super().__init__()
            contexts.append(self)

    def refused(sock: zmq.Socket[bytes], security: ClientSecurity) -> None:
        raise ConfigError("this key is refused by the test")

    monkeypatch.setattr(zmq.asyncio, "Context", Kept)
    monkeypatch.setattr(dealer, "secure_client", refused)
    public, secret = zmq.curve_keypair()
    keys = ClientSecurity(public=public, secret=secret, server_public=public)
    with pytest.raises(ConfigError, match="refused by the test"):
        dealer.Dealer("tcp://127.0.0.1:1", b"w", 1.0, keys)
    control = ControlClient(
        "tcp://127.0.0.1:1", b"w", JoinOptions(abort_grace=600.0), security=keys
    )
    with pytest.raises(EpochalError, match="failed to start: this key is refused by the test"):
        control.start()
    # each context ended: it could not have with a socket of it still open
    assert len(contexts) == 2 and all(c.closed for c in contexts)
