"""How close the coordinator's control plane comes to ZeroMQ's own floor, from 8 to 4,096 workers.

N simulated workers speak the real protocol (``epochal.protocol``'s messages and codec; no torch,
no data plane) over one DEALER socket each, spread over ``--procs`` helper processes, against

- ``epochal``: a real coordinator process (``python -m epochal coordinator``), and
- ``floor``: a bare asyncio ROUTER (``--serve-floor``, in this file) that answers the same
  sequence with frames encoded in advance, reading only each frame's type (``message_type``, the
  codec's look at a frame's first bytes, as the coordinator reads a stranger's frame): what
  ZeroMQ, asyncio and the message sizes cost without any of the coordinator's logic.

The two alternate (which goes first swaps on every repeat). Per N the bench prints, as medians
over the repeats and as ratios epochal / floor:

- rendezvous: from the helpers' common start instant (every worker then creates its socket,
  connects and says hello) to the last worker's ``welcome``;
- control per epoch: from the last ``epoch_report`` of epoch e to the last ``go`` of epoch e+1
  (the decision, which carries that ``go``: everything between two trainings);
- CPU per epoch: the server's user+system time (``/proc/PID/stat``, sampled every 10 ms) from the
  last ``go`` of the first epoch to the last ``go`` of the last one, divided by the epochs between
  (it includes the heartbeats handled during ``--train-seconds``);
- RSS per worker: (peak RSS - RSS once listening) / N.

Every instant is ``time.monotonic()``, which is one clock for every process of the machine.
The workers' message sequence lives in :func:`worker_script` alone, so a change of protocol is
a change of that one function; every frame either side sends is a protocol class through
``encode`` (its fields by name, so that a field added with its default changes nothing here), and
the floor tells frames apart by their registered wire names (``TYPE_NAMES``).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import multiprocessing as mp
import os
import queue
import re
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from epochal.protocol import (
    MAX_FRAME_BYTES,
    Abort,
    Awaiting,
    Decision,
    DescribeModel,
    Done,
    EpochReady,
    EpochReport,
    Fingerprint,
    Finish,
    Go,
    Heartbeat,
    Hello,
    Joined,
    Liveness,
    Metric,
    ModelPage,
    OpenStore,
    ParamSpec,
    Phase,
    Reject,
    Status,
    StoreReady,
    Welcome,
    decode,
    encode,
)
from epochal.protocol.codec import message_type
from epochal.protocol.messages import TYPE_NAMES
from epochal.protocol.paging import model_page

HERE = Path(__file__).resolve().parent
WHERE = "train.py:120 in train_epoch"  # a heartbeat's "where", as long as a real one
PARAMS = (  # the dtypes as a worker names them (epochal.worker.fingerprint): "float32"
    ParamSpec("0.weight", (512, 256), "float32"),
    ParamSpec("0.bias", (512,), "float32"),
    ParamSpec("2.weight", (512, 512), "float32"),
    ParamSpec("2.bias", (512,), "float32"),
    ParamSpec("4.weight", (10, 512), "float32"),
    ParamSpec("4.bias", (10,), "float32"),
)
FINGERPRINT = Fingerprint(digest="0" * 64, torch_version="2.5.1+cpu", entries=len(PARAMS))
METRIC = "accuracy"
"""The one named metric the simulated training code reports (``epochal.train``'s metrics=)."""
METRICS = (Metric(METRIC, 91.0, 100),)
LEARNING_RATE = 0.1
"""The rate the simulated optimizer holds (``epochal.train`` reports its optimizer's)."""


def replica_checksum(epoch: int) -> int:
    """The CRC-32 of the weights after ``epoch``: the same on every rank, as replicas agree."""
    return zlib.crc32(f"weights after epoch {epoch}".encode())


def model_answer(message: DescribeModel) -> ModelPage:
    """The page of the model's entries a ``describe_model`` asks for (the control client answers
    from its own thread, whatever the training code is doing)."""
    return model_page(PARAMS, min(message.first, len(PARAMS)))


def raise_nofile() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return (soft, hard) now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


# ---------------------------------------------------------------------- the simulated worker


@dataclass(frozen=True, slots=True)
class Send:
    message: Any


@dataclass(frozen=True, slots=True)
class Recv:
    timeout: float | None  # None: wait for ever; the answer is None when the timeout passes


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Action = Send | Recv | Sleep
Script = Generator[Action, Any, None]


@dataclass(slots=True)
class SimWorker:
    """One simulated worker's state: what ``epochal.worker.control.client`` keeps beside its
    socket."""

    index: int
    worker_id: str
    phase: Phase = Phase.RENDEZVOUS
    awaiting: Awaiting | None = None
    epoch: int = 0
    step: int = 0
    session: str = ""
    marks: dict[str, float] = field(default_factory=dict)
    # "welcome", "go.E", "report.E", "decision.E": time.monotonic() instants

    def mark(self, what: str) -> None:
        self.marks[what] = time.monotonic()

    def status(self) -> Status:
        return Status(
            phase=self.phase, epoch=self.epoch, step=self.step, where=WHERE, awaiting=self.awaiting
        )

    def frame(self, message: Any) -> bytes:
        """``message`` as this worker sends it: every frame but a hello carries its session."""
        return encode(message, session="" if isinstance(message, Hello) else self.session)

    def at(
        self, phase: Phase, epoch: int, awaiting: Awaiting | None = None, announce: bool = True
    ) -> Iterator[Action]:
        """``ControlClient.at``: a change of phase (or of what it awaits) is reported at once
        with a Status, unless the message sent next says it (``announce`` False)."""
        changed = (phase, awaiting) != (self.phase, self.awaiting)
        self.phase, self.awaiting, self.epoch, self.step = phase, awaiting, epoch, 0
        if changed and announce:
            yield Send(self.status())


def expect(*kinds: type) -> Generator[Action, Any, Any]:
    """``Session._expect``: the next message of ``kinds``, skipping answers to retried hellos."""
    while True:
        message = yield Recv(None)
        if isinstance(message, kinds):
            return message
        if isinstance(message, Welcome | Joined):
            continue
        raise RuntimeError(f"expected {kinds}, got {type(message).__name__}: {message}")


def worker_script(w: SimWorker, train_seconds: float) -> Script:
    """The message sequence of one worker, as ``epochal.worker.session`` speaks it.

    What each message holds is what ``epochal.train``'s workers send
    (``tests/integration/test_bench_frames.py`` compares them): a rank hint, the names of the
    metrics reported, the next epoch's counts with ``gathers`` (its state can be gathered for
    newcomers), each epoch's loss sums with a metric, the learning rate and the replicas' checksum.

    Rendezvous (``_rendezvous``): hello, re-sent with backoff 0.1 s doubling to 2 s until an
    answer; ``joined``; rank 0 gets ``open_store`` and answers ``store_ready``; ``welcome``.
    Then per epoch (``_epoch``): for the first one ``epoch_ready`` -> ``go``; training (a sleep);
    ``epoch_report`` (with the next epoch's batch counts unless it is the last) -> ``decision``
    (with the next epoch's ``go`` unless it stops); after a decision that stops, ``finish`` ->
    ``done``. Status messages go
    out at every change of phase, as ``ControlClient.at`` sends them; the periodic heartbeat is
    the driver's (:class:`Driver`).
    """
    hello = Hello(
        job="epochal",
        token="",
        worker_id=w.worker_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        rank_hint=w.index,  # a launcher passes each worker its index
        device="cpu",
        fingerprint=FINGERPRINT,
        data_address="127.0.0.1",
        metrics=(METRIC,),
    )
    backoff, joined = 0.1, False
    yield Send(hello)
    while True:
        message = yield Recv(None if joined else backoff)
        if message is None:
            backoff = min(backoff * 2, 2.0)
            yield Send(hello)
        elif isinstance(message, Joined):
            joined = True
        elif isinstance(message, OpenStore):
            yield from w.at(Phase.CONNECT, 0)
            yield Send(StoreReady(host="127.0.0.1", port=29500, key=secrets.token_hex(16)))
        elif isinstance(message, Welcome):
            w.mark("welcome")
            epoch, epochs = message.start_epoch, message.epochs
            replica_check = message.replica_check
            break
        elif isinstance(message, Reject | Abort):
            raise RuntimeError(f"{type(message).__name__}: {message.reason}")
    yield from w.at(Phase.SETUP, epoch)
    go: Go | None = None  # the go the last decision carried
    while True:
        if go is None:
            yield from w.at(Phase.WAITING, epoch, Awaiting.GO, announce=False)
            yield Send(EpochReady(epoch=epoch, train_batches=100, valid_batches=10, gathers=True))
            answer = yield from expect(Go, Finish)
            if isinstance(answer, Finish):
                break
            go = answer
        w.mark(f"go.{epoch}")
        yield from w.at(Phase.TRAIN, epoch, announce=False)  # the go said it
        if train_seconds > 0:
            yield Sleep(train_seconds)
        yield from w.at(Phase.VALIDATE, epoch, announce=False)  # the next heartbeat says it
        yield from w.at(Phase.WAITING, epoch, Awaiting.DECISION, announce=False)
        ready = (
            EpochReady(epoch=epoch + 1, train_batches=100, valid_batches=10, gathers=True)
            if epoch + 1 < epochs
            else None
        )
        yield Send(
            EpochReport(
                epoch=epoch,
                train_loss_sum=230.0,
                train_count=100,
                valid_loss_sum=23.0,
                valid_count=10,
                train_metrics=METRICS,
                valid_metrics=METRICS,
                ready=ready,
                checksum=replica_checksum(epoch) if replica_check else None,
                lr=LEARNING_RATE,
            )
        )
        w.mark(f"report.{epoch}")
        decision = yield from expect(Decision)
        w.mark(f"decision.{epoch}")
        epoch += 1
        if decision.stop:
            yield from w.at(Phase.FINISHING, epoch)
            yield from expect(Finish)
            break
        go = decision.go
    yield Send(Done())


class Driver:
    """Runs many :func:`worker_script` s in one process: a zmq.Poller and a timer heap.

    Like ``ControlClient``: one DEALER per worker with its routing nonce and socket options, a
    heartbeat (Status) once ``heartbeat_interval`` passed without a frame sent, the session
    taken from joined/welcome and sent with every frame but a hello, heartbeats from the
    coordinator swallowed, a request for the model's entries (``describe_model``) answered at
    once with the page asked for.
    """

    def __init__(self, endpoint: str, first: int, count: int, args: dict[str, Any]) -> None:
        self.endpoint = endpoint
        self.interval = float(args["heartbeat_interval"])
        self.train_seconds = float(args["train_seconds"])
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, count + 64)
        host = socket.gethostname()
        self.workers = [
            SimWorker(i, f"{host}/{os.getpid()}/{i:06x}") for i in range(first, first + count)
        ]
        self.sockets: list[zmq.Socket[bytes]] = []
        self.scripts: list[Script | None] = []
        self.waiting: list[int | None] = []  # per worker: the token of its pending Recv, if any
        self.inbox: list[deque[Any]] = []
        self.timers: list[tuple[float, int, int, str, int]] = []
        self.seq = itertools.count()
        self.errors: dict[int, str] = {}
        self.by_socket: dict[zmq.Socket[bytes], int] = {}
        self.poller = zmq.Poller()
        self.decoded: dict[bytes, Any] = {}
        self.sent_at: list[float] = []  # per worker: when it last sent a frame

    def _timer(self, due: float, k: int, kind: str, token: int = 0) -> None:
        heapq.heappush(self.timers, (due, next(self.seq), k, kind, token))

    def start(self) -> None:
        for k, w in enumerate(self.workers):
            sock = self.ctx.socket(zmq.DEALER)
            nonce = b"#" + secrets.token_hex(8).encode()
            sock.setsockopt(zmq.IDENTITY, w.worker_id.encode()[: 255 - len(nonce)] + nonce)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.connect(self.endpoint)
            self.sockets.append(sock)
            self.by_socket[sock] = k
            self.poller.register(sock, zmq.POLLIN)
            self.scripts.append(worker_script(w, self.train_seconds))
            self.waiting.append(None)
            self.inbox.append(deque())
            self.sent_at.append(time.monotonic())
            self._timer(time.monotonic() + self.interval, k, "beat")
            self._advance(k, None)

    def _send(self, k: int, message: Any) -> None:
        self.sockets[k].send(self.workers[k].frame(message))
        self.sent_at[k] = time.monotonic()

    def _advance(self, k: int, value: Any) -> None:
        """Resume worker k's script with ``value`` until it waits (Recv, Sleep) or ends."""
        script = self.scripts[k]
        while script is not None:
            try:
                action = script.send(value)
            except StopIteration:
                self.scripts[k] = None
                return
            except Exception as exc:  # an abort or a protocol surprise: recorded, others go on
                self.errors[self.workers[k].index] = f"{type(exc).__name__}: {exc}"
                self.scripts[k] = None
                return
            value = None
            if isinstance(action, Send):
                self._send(k, action.message)
            elif isinstance(action, Sleep):
                self._timer(time.monotonic() + action.seconds, k, "wake")
                return
            elif self.inbox[k]:
                value = self.inbox[k].popleft()
            else:
                token = next(self.seq)
                self.waiting[k] = token
                if action.timeout is not None:
                    self._timer(time.monotonic() + action.timeout, k, "timeout", token)
                return

    def _decode(self, data: bytes) -> Any:
        """``decode``, once per distinct frame: a broadcast (go, decision, heartbeat) is the same
        bytes for every worker, and decoding it once per process keeps the helpers' CPU for
        sending and receiving. The messages are frozen dataclasses, safe to share."""
        message = self.decoded.get(data)
        if message is None:
            message = decode(data)
            if len(self.decoded) >= 64:
                self.decoded.clear()
            self.decoded[data] = message
        return message

    def _deliver(self, k: int, data: bytes) -> None:
        message = self._decode(data)
        if isinstance(message, Heartbeat):
            return
        if isinstance(message, DescribeModel):  # the client answers these on its own thread
            self._send(k, model_answer(message))
            return
        if isinstance(message, Joined | Welcome):
            self.workers[k].session = message.session
        if self.waiting[k] is not None:
            self.waiting[k] = None
            self._advance(k, message)
        else:
            self.inbox[k].append(message)

    def run(self, deadline: float, stop: Any) -> None:
        live = len(self.workers)
        while live and time.monotonic() < deadline and not stop.is_set():
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, k, kind, token = heapq.heappop(self.timers)
                if self.scripts[k] is None:
                    continue
                if kind == "beat":  # due an interval after the last frame sent
                    if now - self.sent_at[k] >= self.interval:
                        self._send(k, self.workers[k].status())
                    self._timer(self.sent_at[k] + self.interval, k, "beat")
                elif kind == "wake":
                    self._advance(k, None)
                elif self.waiting[k] == token:  # a Recv timed out
                    self.waiting[k] = None
                    self._advance(k, None)
            timeout = 200.0 if not self.timers else max(0.0, self.timers[0][0] - now) * 1000
            for sock, _ in self.poller.poll(timeout=min(timeout, 200.0)):
                k = self.by_socket[sock]  # type: ignore[index]
                while self.scripts[k] is not None:
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._deliver(k, data)
            live = sum(s is not None for s in self.scripts)
        for k, script in enumerate(self.scripts):
            if script is not None:
                self.errors.setdefault(
                    self.workers[k].index, "still running when the bench gave up on the run"
                )

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=1000)
        self.ctx.term()


def helper_main(
    endpoint: str,
    first: int,
    count: int,
    args: dict[str, Any],
    ready: Any,
    go: Any,
    out: Any,
    stop: Any,
) -> None:
    """A helper process: wait for the common start, then run its share of the workers."""
    raise_nofile()
    driver = Driver(endpoint, first, count, args)
    ready.put(os.getpid())
    start_at = go.get()
    time.sleep(max(0.0, start_at - time.monotonic()))
    driver.start()
    driver.run(start_at + float(args["run_timeout"]), stop)
    out.put(([w.marks for w in driver.workers], driver.errors))
    driver.close()


# ---------------------------------------------------------------------- the floor


@dataclass(frozen=True, slots=True)
class FloorFrames:
    """The coordinator's answers to the worker sequence, encoded in advance for the floor (and
    for ``tests/integration/test_bench_frames.py``, which drives :func:`worker_script` with
    them)."""

    joined: bytes
    welcomes: list[bytes]  # per rank
    first_go: bytes
    decisions: list[bytes]  # per epoch: each carries the next epoch's go, the last one stops
    finish: bytes
    open_store: bytes
    heartbeat: bytes


def floor_frames(world_size: int, epochs: int, heartbeat_interval: float) -> FloorFrames:
    session = "f" * 43
    liveness = Liveness(interval=heartbeat_interval, timeout=max(15.0, 2 * heartbeat_interval))
    gos = [Go(epoch=e, train_batches=100, valid_batches=10, lr_factor=1.0) for e in range(epochs)]
    return FloorFrames(
        joined=encode(Joined(joined=1, world_size=world_size, session=session, liveness=liveness)),
        welcomes=[
            encode(
                Welcome(
                    rank=r,
                    world_size=world_size,
                    run_id="0" * 12,
                    backend="gloo",
                    store_host="127.0.0.1",
                    store_port=29500,
                    start_epoch=0,
                    epochs=epochs,
                    resume_epoch=None,
                    checkpoint_dir="",
                    session=session,
                    liveness=liveness,
                    store_key="0" * 32,
                )
            )
            for r in range(world_size)
        ],
        first_go=encode(gos[0]),
        decisions=[
            encode(
                Decision(
                    epoch=e,
                    train_loss=2.3,
                    valid_loss=2.3,
                    smoothed_loss=2.3,
                    best_epoch=0,
                    is_best=e == 0,
                    checkpoint=False,
                    stop=e == epochs - 1,
                    train_metrics=METRICS,
                    valid_metrics=METRICS,
                    go=gos[e + 1] if e + 1 < epochs else None,
                )
            )
            for e in range(epochs)
        ],
        finish=encode(Finish(best_epoch=0, best_loss=2.3, epochs_run=epochs, restore_best=True)),
        open_store=encode(OpenStore(run_id="0" * 12)),
        heartbeat=encode(Heartbeat()),
    )


def serve_floor(
    world_size: int, epochs: int, heartbeat_interval: float, backlog: int, awaited: bool = False
) -> None:
    """A bare asyncio ROUTER answering the worker sequence with pre-encoded frames.

    It waits for frames with asyncio and then reads and sends through the socket's synchronous
    shadow, as the coordinator does; ``awaited``: through pyzmq's awaitable calls instead, a
    future per frame (the coordinator's way before, ``--floor-io awaited``)."""
    import zmq.asyncio

    raise_nofile()
    frames = floor_frames(world_size, epochs, heartbeat_interval)
    joined, welcomes, first_go = frames.joined, frames.welcomes, frames.first_go
    decisions, finish, open_store = frames.decisions, frames.finish, frames.open_store
    heartbeat = frames.heartbeat

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.BACKLOG, backlog or max(100, world_size))
        sock.bind("tcp://127.0.0.1:0")
        io = zmq.Socket.shadow(sock.underlying)  # reads and sends that never wait, as the service
        print(f"listening on {sock.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
        peers: dict[bytes, int] = {}
        hello, store_ready = TYPE_NAMES[Hello], TYPE_NAMES[StoreReady]
        epoch_ready, epoch_report, done = (TYPE_NAMES[c] for c in (EpochReady, EpochReport, Done))
        counts = {epoch_ready: 0, epoch_report: 0, done: 0}
        next_beat = time.monotonic() + heartbeat_interval
        store_asked = False

        def answer(peer: bytes, data: bytes) -> list[list[bytes]]:
            """The frames that answer one frame from ``peer``."""
            nonlocal store_asked
            kind = message_type(data)
            if kind == hello:
                peers.setdefault(peer, len(peers))
                out = [[peer, joined]]
                if len(peers) == world_size and not store_asked:
                    store_asked = True
                    out.append([next(iter(peers)), open_store])
                return out
            if kind == store_ready:
                return [[p, welcomes[rank]] for p, rank in peers.items()]
            if kind in counts:
                counts[kind] += 1
                n = counts[kind]
                if kind == epoch_ready and n == world_size:  # the first epoch only
                    return [[p, first_go] for p in peers]
                if kind == epoch_report and n % world_size == 0:
                    e = n // world_size - 1
                    out = [[p, decisions[e]] for p in peers]
                    if e == epochs - 1:
                        out += [[p, finish] for p in peers]
                    return out
            return []

        while counts[done] < world_size:
            await sock.poll(timeout=int(heartbeat_interval * 1000))
            if awaited:
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    peer, data = await sock.recv_multipart()
                    for frames in answer(peer, data):
                        await sock.send_multipart(frames)
            else:
                while True:
                    try:
                        peer, data = io.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    for frames in answer(peer, data):
                        io.send_multipart(frames, zmq.NOBLOCK)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + heartbeat_interval
                for peer in peers:
                    if awaited:
                        await sock.send_multipart([peer, heartbeat])
                    else:
                        io.send_multipart([peer, heartbeat], zmq.NOBLOCK)
        sock.close(linger=2000)
        ctx.term()

    asyncio.run(main())


# ---------------------------------------------------------------------- one run


class Sampler(threading.Thread):
    """Samples a process's CPU time and RSS from /proc every 10 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, float]] = []  # (monotonic, cpu seconds)
        self.peak_rss = 0
        self.stopped = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def cpu(self) -> float | None:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self.tick

    def run(self) -> None:
        while not self.stopped.wait(0.01):
            cpu = self.cpu()
            rss = rss_kib(self.pid)
            if cpu is None or rss is None:
                return
            self.samples.append((time.monotonic(), cpu))
            self.peak_rss = max(self.peak_rss, rss)

    def cpu_at(self, t: float) -> float:
        """CPU seconds at instant t: the last sample at or before it."""
        best = self.samples[0][1]
        for when, cpu in self.samples:
            if when > t:
                break
            best = cpu
        return best


def rss_kib(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(found.group(1)) if found else None


@dataclass
class Result:
    mode: str
    n: int
    ok: bool
    rendezvous: float | None = None
    control: list[float] = field(default_factory=list)
    cpu_per_epoch: float | None = None
    rss_listening: int = 0
    rss_peak: int = 0
    cpu_total: float = 0.0
    note: str = ""

    @property
    def rss_per_worker(self) -> float:
        return (self.rss_peak - self.rss_listening) / self.n


def server_command(mode: str, n: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    if mode == "floor":
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve-floor",
            str(n),
            str(args.epochs),
            str(args.heartbeat_interval),
            str(args.floor_backlog),
            args.floor_io,
        ]
    return [
        sys.executable,
        "-m",
        "epochal",
        "coordinator",
        "--world-size",
        str(n),
        "--epochs",
        str(args.epochs),
        "--checkpoint-every",
        "0",
        "--run-dir",
        str(run_dir),
        "--rendezvous-timeout",
        f"{args.join_timeout:g}",
        "--heartbeat-interval",
        f"{args.heartbeat_interval:g}",
        *args.coordinator_args.split(),
    ]


def _limit_nofile(limit: int | None) -> Any:
    if limit is None:
        return None

    def apply() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))

    return apply


def run_once(mode: str, n: int, args: argparse.Namespace, scratch: Path, tag: str) -> Result:
    run_dir = scratch / f"{tag}-{mode}-{n}"
    log_path = scratch / f"{tag}-{mode}-{n}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            server_command(mode, n, args, run_dir),
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            preexec_fn=_limit_nofile(args.coordinator_nofile if mode == "epochal" else None),
        )
    result = Result(mode, n, ok=False)
    assert server.stdout is not None
    line = server.stdout.readline()
    found = re.search(r"(tcp://\S+)", line)
    if not found:
        server.wait(timeout=30)
        result.note = f"the server did not start: {line!r} {log_path.read_text()[-500:]!r}"
        return result
    endpoint = found.group(1)
    threading.Thread(target=server.stdout.read, daemon=True).start()  # drain stdout
    result.rss_listening = rss_kib(server.pid) or 0
    sampler = Sampler(server.pid)
    sampler.start()
    spy = None
    if args.py_spy is not None and mode == "epochal":  # a profile of the coordinator's run
        args.py_spy.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen(
            [
                *("py-spy", "record", "--pid", str(server.pid), "--rate", "250"),
                *("--format", "raw", "--output", str(args.py_spy / f"{tag}-{n}.txt")),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    ctx = mp.get_context("spawn")
    ready, go, out, stop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = min(args.procs, n)
    shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    helper_args = {
        "heartbeat_interval": args.heartbeat_interval,
        "train_seconds": args.train_seconds,
        "run_timeout": args.run_timeout,
    }
    helpers = []
    first = 0
    for count in shares:
        p = ctx.Process(
            target=helper_main, args=(endpoint, first, count, helper_args, ready, go, out, stop)
        )
        p.start()
        helpers.append(p)
        first += count
    for _ in helpers:
        ready.get(timeout=120)
    start_at = time.monotonic() + 0.3
    for _ in helpers:
        go.put(start_at)
    marks: list[dict[str, float]] = []
    errors: dict[int, str] = {}
    exited: float | None = None
    pending = len(helpers)
    while pending:
        try:
            got_marks, got_errors = out.get(timeout=1.0)
        except queue.Empty:
            # the server is gone: give the workers a moment to read what it said last, then stop
            if exited is None and server.poll() is not None:
                exited = time.monotonic()
            if exited is not None and time.monotonic() - exited > 5:
                stop.set()
            continue
        marks.extend(got_marks)
        errors.update(got_errors)
        pending -= 1
    for p in helpers:
        p.join(timeout=30)
    try:
        rc = server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        rc = server.wait()
    sampler.stopped.set()
    sampler.join()
    if spy is not None:
        spy.wait(timeout=60)  # it writes its profile when the coordinator has exited
    result.rss_peak = sampler.peak_rss
    if sampler.samples:
        result.cpu_total = sampler.samples[-1][1]
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
    if errors or rc != 0:
        first_error = next(iter(errors.values()), "")
        result.note = (
            f"exit {rc}; {len(errors)} of {n} workers failed ({first_error[:200]}); "
            f"server log: {' | '.join(t[:300] for t in tail)}"
        )
    welcomed = [m["welcome"] for m in marks if "welcome" in m]
    if len(welcomed) == n:
        result.rendezvous = max(welcomed) - start_at
    last = args.epochs - 1
    for e in range(last):
        reports = [m.get(f"report.{e}") for m in marks]
        gos = [m.get(f"go.{e + 1}") for m in marks]
        if None in reports or None in gos:
            break
        result.control.append(max(gos) - max(reports))  # type: ignore[type-var]
    if len(result.control) == last and last > 0:
        t0 = max(m["go.0"] for m in marks)
        t1 = max(m[f"go.{last}"] for m in marks)
        result.cpu_per_epoch = (sampler.cpu_at(t1) - sampler.cpu_at(t0)) / last
    result.ok = rc == 0 and not errors and result.rendezvous is not None
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


# ---------------------------------------------------------------------- report


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, scale: float, digits: int) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def describe(r: Result) -> str:
    control = _median(r.control)
    return (
        f"{r.mode:<8}{r.n:>6}  rendezvous {_fmt(r.rendezvous, 1, 3):>7} s  "
        f"control {_fmt(control, 1000, 1):>7} ms  cpu/epoch {_fmt(r.cpu_per_epoch, 1000, 0):>5} ms"
        f"  rss {r.rss_peak / 1024:6.1f} MiB ({r.rss_per_worker:6.1f} KiB/worker)"
        f"  cpu {r.cpu_total:.1f} s in all" + ("" if r.ok else f"  FAILED: {r.note}")
    )


def summarize(results: list[Result]) -> str:
    lines = [
        "",
        "medians over the repeats that completed; ratio = epochal / floor",
        f"{'N':>6}  {'rendezvous s':>17}  {'control ms/epoch':>19}  {'cpu ms/epoch':>17}  "
        f"{'RSS KiB/worker':>19}  {'RSS MiB':>13}  runs ok",
        f"{'':>6}  {'epochal floor x':>17}  {'epochal floor x':>19}  {'epochal floor x':>17}  "
        f"{'epochal floor x':>19}  {'epochal floor':>13}",
    ]
    for n in sorted({r.n for r in results}):
        row = []
        ok = {}
        for mode in ("epochal", "floor"):
            good = [r for r in results if r.n == n and r.mode == mode and r.ok]
            ok[mode] = f"{len(good)}/{sum(1 for r in results if r.n == n and r.mode == mode)}"
            row.append(
                (
                    _median([r.rendezvous for r in good if r.rendezvous is not None]),
                    _median([c for r in good for c in r.control]),
                    _median([r.cpu_per_epoch for r in good if r.cpu_per_epoch is not None]),
                    _median([r.rss_per_worker for r in good]),
                    _median([r.rss_peak / 1024 for r in good]),
                )
            )
        (er, ec, eu, ew, em), (fr, fc, fu, fw, fm) = row
        lines.append(
            f"{n:>6}  {_fmt(er, 1, 3):>7} {_fmt(fr, 1, 3):>5} {_ratio(er, fr):>4}  "
            f"{_fmt(ec, 1000, 1):>7} {_fmt(fc, 1000, 1):>6} {_ratio(ec, fc):>5}  "
            f"{_fmt(eu, 1000, 0):>6} {_fmt(fu, 1000, 0):>5} {_ratio(eu, fu):>5}  "
            f"{_fmt(ew, 1, 1):>7} {_fmt(fw, 1, 1):>6} {_ratio(ew, fw):>5}  "
            f"{_fmt(em, 1, 1):>6} {_fmt(fm, 1, 1):>6}  {ok['epochal']} {ok['floor']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8, 64, 256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--procs", type=int, default=4, help="helper processes (default: 4)")
    parser.add_argument(
        "--train-seconds",
        type=float,
        default=0.1,
        help="each simulated epoch's training: a sleep (default: 0.1)",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--join-timeout", type=float, default=300.0)
    parser.add_argument(
        "--run-timeout", type=float, default=600.0, help="a run still going after this fails"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=("epochal", "floor"), default=["epochal", "floor"]
    )
    parser.add_argument(
        "--coordinator-nofile",
        type=int,
        default=None,
        metavar="K",
        help="start the coordinator with a soft RLIMIT_NOFILE of K (e.g. 1024, a common default)",
    )
    parser.add_argument(
        "--coordinator-args", default="", help="more options for `epochal coordinator`"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep run dirs and logs here")
    parser.add_argument(
        "--floor-backlog",
        type=int,
        default=0,
        metavar="K",
        help="the floor's listen backlog (default: N; libzmq's own default is 100)",
    )
    parser.add_argument(
        "--floor-io",
        choices=("shadow", "awaited"),
        default="shadow",
        help="how the floor reads and sends: through the socket's synchronous shadow, as the "
        "coordinator does (default), or pyzmq's awaitable calls, a future per frame",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="profile each coordinator with py-spy (pip install py-spy) into DIR/TAG-N.txt, as "
        "collapsed stacks",
    )
    parser.add_argument("--serve-floor", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_floor:
        n, epochs, hb, backlog, io = args.serve_floor
        serve_floor(int(n), int(epochs), float(hb), int(backlog), io == "awaited")
        return 0
    soft, hard = raise_nofile()
    print(
        f"open files: soft limit {soft}, hard {hard}; {os.cpu_count()} CPUs; "
        f"{args.procs} helper processes; {args.epochs} epochs of {args.train_seconds:g} s",
        flush=True,
    )
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="epochal-control-plane-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for n in args.n:
        for repeat in range(args.repeats):
            order = list(args.modes) if repeat % 2 == 0 else list(reversed(args.modes))
            for mode in order:
                r = run_once(mode, n, args, scratch, f"r{repeat}")
                results.append(r)
                print(describe(r), flush=True)
    print(summarize(results), flush=True)
    if args.keep is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
