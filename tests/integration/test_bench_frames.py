"""``bench/control_plane.py``'s simulated workers send what ``epochal.train``'s workers send.

A bench whose workers send less than real ones measures a coordinator that does less (no replica
checksums to compare, no learning rate to record, no metric names to check). So a real run of two
``epochal.train`` workers (``scripts/resumable.py``) goes through a relay that records every frame
the coordinator receives, and the bench's :func:`worker_script` is driven through the same
epochs with the coordinator's answers; both sides' frames are then read as key -> type maps,
nested, per message type. The next field a worker sends with a value of its own fails here until
the bench sends it too.

Every bound is a configured timeout: the run ends within its rendezvous timeout plus its stall
abort.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest

from epochal.protocol import TYPE_KEY, DescribeModel, Joined, OpenStore, Welcome, decode
from tests.integration.conftest import Spawner, StandaloneRun, TcpRelay

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "control_plane.py"
EPOCHS = 2
WORLD = 2
HEARTBEAT_INTERVAL = 0.5
RENDEZVOUS_TIMEOUT = 60.0
STALL_ABORT = 60.0
LIMIT = RENDEZVOUS_TIMEOUT + STALL_ABORT
"""The longest the run may take: every worker joined within the rendezvous timeout, then no
stretch of more than the stall abort without progress."""


def bench_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_control_plane", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the recording relay


class Relay(TcpRelay):
    """A TCP relay in front of the coordinator that reads the ZMTP stream each worker sends
    (NULL mechanism: a 64-byte greeting, then frames of a flags byte, a 1- or 8-byte size and a
    body; commands skipped) and keeps each message's body, the frame the coordinator receives."""

    GREETING = 64
    MORE, LONG, COMMAND = 0x01, 0x02, 0x04

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.frames: list[bytes] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def watch(self, upstream: bool) -> Callable[[bytes], None] | None:
        """The parser of a worker's stream (the coordinator's answers are not read)."""
        if not upstream:
            return None
        parse = self.parser()
        next(parse)

        def seen(data: bytes) -> None:
            nonlocal parse
            if parse is None:
                return
            try:
                parse.send(data)
            except Exception as exc:  # named in the test's failure, never a silent gap
                self.errors.append(f"{type(exc).__name__}: {exc}")
                parse = None

        return seen

    def parser(self) -> Iterator[None]:
        """Fed the stream's bytes as they come (``send``); records each message it completes."""
        buffer = bytearray()

        def take(n: int) -> Iterator[None]:
            while len(buffer) < n:
                buffer.extend((yield))

        yield from take(self.GREETING)
        mechanism = bytes(buffer[12:32]).rstrip(b"\0")
        if mechanism != b"NULL":
            raise ValueError(f"the relay reads only the NULL mechanism, not {mechanism!r}")
        del buffer[: self.GREETING]
        parts: list[bytes] = []
        while True:
            yield from take(2)
            flags = buffer[0]
            width = 8 if flags & self.LONG else 1
            yield from take(1 + width)
            size = int.from_bytes(buffer[1 : 1 + width], "big")
            yield from take(1 + width + size)
            body = bytes(buffer[1 + width : 1 + width + size])
            del buffer[: 1 + width + size]
            if flags & self.COMMAND:
                continue
            parts.append(body)
            if not flags & self.MORE:
                with self.lock:
                    self.frames.extend(parts)
                parts = []


# ----------------------------------------------------------------------------- key -> type maps

Shape = dict[str, dict[str, set[str]]]
"""Per message type (and per nested record, ``epoch_report.ready``): per key, the value types
seen (``int``, ``float``, ``str``, ``true``, ``false``, ``nil``, ``map``, ``list``)."""


def kind(value: Any) -> str:
    """A value's type; a flag's value too (``gathers`` true or false: the coordinator does more
    for one of them)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "map"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def shapes(frames: list[bytes]) -> Shape:
    out: Shape = defaultdict(lambda: defaultdict(set))

    def walk(where: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                out[where][key].add(kind(item))
                walk(f"{where}.{key}", item)
        elif isinstance(value, list):
            for item in value:
                out[where]["[]"].add(kind(item))
                walk(f"{where}[]", item)

    for frame in frames:
        plain = msgpack.unpackb(frame)
        walk(plain[TYPE_KEY], plain)
    return out


def differences(real: Shape, bench: Shape) -> list[str]:
    """What the real workers sent that the bench's do not: a message type or key it never sends,
    or a type of value it never sends there. The bench may send a value where the real run
    happened to send only nil (a heartbeat's ``awaiting``, sent or not while a rank waited)."""
    found = []
    for where, keys in sorted(real.items()):
        if where not in bench:
            found.append(f"{where}: the bench sends none")
            continue
        for key, types in sorted(keys.items()):
            ours = bench[where].get(key, set())
            if not types <= ours or (ours - types and types != {"nil"}):
                found.append(f"{where}.{key}: real {sorted(types)}, bench {sorted(ours)}")
        for key in sorted(bench[where].keys() - keys.keys()):
            found.append(f"{where}.{key}: only the bench sends it")
    return found


# ----------------------------------------------------------------------------- the two sides


def real_frames(spawn: Spawner) -> list[bytes]:
    run = StandaloneRun(
        spawn,
        WORLD,
        "--epochs",
        str(EPOCHS),
        "--checkpoint-every",
        "0",  # as the bench's coordinator
        "--rendezvous-timeout",
        f"{RENDEZVOUS_TIMEOUT:g}",
        "--stall-abort",
        f"{STALL_ABORT:g}",
        "--heartbeat-interval",
        f"{HEARTBEAT_INTERVAL:g}",
    )
    relay = Relay(int(run.endpoint.rsplit(":", 1)[1]))
    relay.start()
    try:
        run.start_workers(
            "--accuracy", delay=0.0, connect=dict.fromkeys(range(WORLD), relay.endpoint)
        )
        code, output = run.finish_coordinator(LIMIT)
        assert code == 0, output
        for worker in run.workers:
            worker_code, worker_output = spawn.finish(worker, LIMIT)
            assert worker_code == 0, worker_output
    finally:
        relay.close()
    assert not relay.errors, relay.errors
    return relay.frames


def bench_frames(bench: ModuleType) -> list[bytes]:
    """What the bench's simulated workers send in a run of ``EPOCHS`` epochs: each one's script
    answered as the coordinator answers (rank 0 asked to open the store and to describe its
    model), and a heartbeat after every step of it, in whatever phase it is then."""
    answers = bench.floor_frames(WORLD, EPOCHS, HEARTBEAT_INTERVAL)
    sent: list[bytes] = []
    for rank in range(WORLD):
        w = bench.SimWorker(rank, f"testhost/1/{rank:06x}")
        script = bench.worker_script(w, 0.0)
        replies = [answers.joined]
        if rank == 0:
            replies += [answers.open_store]
        replies += [answers.welcomes[rank], answers.first_go, *answers.decisions, answers.finish]
        inbox = iter(replies)
        value = None
        while True:
            try:
                action = script.send(value)
            except StopIteration:
                break
            value = None
            if isinstance(action, bench.Send):
                sent.append(w.frame(action.message))
            elif isinstance(action, bench.Recv):
                value = decode(next(inbox))
                if isinstance(value, Joined | Welcome):
                    w.session = value.session
                if isinstance(value, OpenStore):  # and its model, which the run records
                    sent.append(w.frame(bench.model_answer(DescribeModel(first=0))))
            if w.session:
                sent.append(w.frame(w.status()))
    return sent


@pytest.mark.timeout(int(LIMIT + 60))
def test_the_bench_workers_send_what_real_workers_send(spawn: Spawner) -> None:
    real_sent, bench_sent = real_frames(spawn), bench_frames(bench_module())
    real, bench = shapes(real_sent), shapes(bench_sent)
    assert not differences(real, bench), "\n".join(differences(real, bench))
    # and a model's entries are named as a worker names them ("float32", not "torch.float32")
    assert dtypes(bench_sent) <= dtypes(real_sent), (dtypes(bench_sent), dtypes(real_sent))


def dtypes(frames: list[bytes]) -> set[str]:
    pages = [msgpack.unpackb(f) for f in frames]
    return {p["dtype"] for page in pages if page[TYPE_KEY] == "model_page" for p in page["params"]}
