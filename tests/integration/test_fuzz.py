"""Thousands of malformed, oversized, truncated and replayed frames at a live coordinator.

A real 2-worker job runs meanwhile; it must finish with exactly the weights of an undisturbed
run, the coordinator must stay up, and its memory must stay bounded.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from epochal.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    EpochReport,
    Fingerprint,
    Status,
    encode,
)
from tests.conftest import hello
from tests.integration.conftest import SCRIPTS, Spawner, standalone_run

pytestmark = pytest.mark.slow

DEADLINE = 120.0
POLICY = ["--epochs", "4", "--lr-schedule", "step:every=2,gamma=0.5"]


def valid_frames() -> list[bytes]:
    fp = Fingerprint(digest="f" * 64, torch_version="x", entries=1)
    return [
        encode(hello("intruder", fp, host="h")),
        encode(
            EpochReport(
                epoch=0, train_loss_sum=1.0, train_count=1, valid_loss_sum=0.0, valid_count=0
            )
        ),
        encode(Status(phase="train", epoch=1, step=1, where="")),
    ]


class Fuzzer(threading.Thread):
    """Sends junk from many identities until stopped; counts what it sent."""

    def __init__(self, endpoint: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.sent = {
            "random": 0,
            "truncated": 0,
            "replayed": 0,
            "foreign": 0,
            "oversized": 0,
            "bomb": 0,
        }

    def socket(self, ctx: zmq.Context) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"fuzz-{self.rng.randrange(1 << 30)}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.connect(self.endpoint)
        return sock

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test, not lost in a thread
            self.error = exc

    def _run(self) -> None:
        good = valid_frames()
        bombs = small_bombs()
        ctx = zmq.Context()
        socks = [self.socket(ctx) for _ in range(8)]
        try:
            while not self.stop.is_set():
                sock = self.rng.choice(socks)
                kind = self.rng.choices(list(self.sent), weights=[40, 25, 20, 14, 1, 5], k=1)[0]
                if kind == "random":
                    frame = self.rng.randbytes(self.rng.randrange(0, 2000))
                elif kind == "truncated":
                    whole = self.rng.choice(good)
                    frame = whole[: self.rng.randrange(0, len(whole))]
                elif kind == "replayed":
                    frame = self.rng.choice(good)
                elif kind == "bomb":
                    frame = self.rng.choice(bombs)
                elif kind == "foreign":
                    frame = msgpack.packb({"v": self.rng.randrange(2, 99), "t": "hello"})
                else:  # libzmq drops the frame and the connection: a throwaway socket
                    frame = b"\0" * (MAX_FRAME_BYTES + 4096)
                    sock = self.socket(ctx)
                try:
                    sock.send(frame, zmq.NOBLOCK)
                    self.sent[kind] += 1
                except zmq.Again:
                    pass
                if kind == "oversized":
                    sock.close(linger=1000)  # libzmq still delivers it, then lets go
                    continue
                while True:  # drain the rejections, as a real peer would
                    try:
                        sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                if sum(self.sent.values()) % 200 == 0:
                    time.sleep(0.01)  # leave the 2 cores some room for the job itself
        finally:
            for sock in socks:
                sock.close(linger=0)
            ctx.term()


def bomb(size: int, *, filler: bytes = b"\x90", field: bytes = b"\xa3job") -> bytes:
    """A well-formed hello of about ``size`` bytes whose ``field`` holds ``filler`` repeated (a
    hello: the one message a stranger's frame is decoded as).

    Plain msgpack decoding turns each 1-byte empty array into a 56-byte list: a frame at the
    64 KiB limit is about 4 MiB of objects (at the 16 MiB limit before, about a gigabyte).
    """
    head = b"\x83\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa1t\xa5hello" + field
    count = (size - len(head) - 5) // len(filler)
    return head + b"\xdd" + count.to_bytes(4, "big") + filler * count


def small_bombs() -> list[bytes]:
    """Frames shaped to make a decoder allocate, each small enough to send thousands of."""
    hello = msgpack.unpackb(valid_frames()[0])
    deep = hello | {"fingerprint": hello["fingerprint"] | {"params": [[[[[]]]]] * 2000}}
    return [
        bomb(64 * 1024),  # an array of empty arrays
        bomb(64 * 1024, filler=b"\x80"),  # of empty maps
        bomb(64 * 1024, filler=b"\xcd\x01\x01"),  # of 3-byte ints
        bomb(64 * 1024, field=b"\xa5extra"),  # under a field no message declares
        b"\x91" * 60_000,  # nested one-element arrays, as deep as it goes
        b"\xdf\xff\xff\xff\xff" + b"\xa0\x80" * 30_000,  # a map claiming 4 billion entries
        msgpack.packb(deep),  # lists where a fingerprint declares parameter maps
    ]


def peak_memory_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def test_a_live_coordinator_shrugs_off_junk(spawn: Spawner, tmp_path: Path):
    # the undisturbed run
    reference = spawn.epochal(
        "run",
        "--nproc",
        "2",
        *POLICY,
        "--run-dir",
        str(tmp_path / "ref"),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "ref-out"),
    )
    code, output = spawn.finish(reference, DEADLINE)
    assert code == 0, output

    run = standalone_run(spawn, *POLICY)
    # fuzz once the run is under way (a hello before the rendezvous completes would be a worker)
    run.wait_for_first_epoch()
    deadline = time.monotonic() + DEADLINE
    fuzzers = [Fuzzer(run.endpoint, seed) for seed in (1, 2)]
    for f in fuzzers:
        f.start()
    peak = 0
    while any(w.poll() is None for w in run.workers):
        peak = max(peak, peak_memory_kb(run.coordinator.pid))
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.1)
    for f in fuzzers:
        f.stop.set()
        f.join(timeout=10)
    sent = {k: sum(f.sent[k] for f in fuzzers) for k in fuzzers[0].sent}
    assert all(f.error is None for f in fuzzers), [f.error for f in fuzzers]

    for worker in run.workers:
        code, output = spawn.finish(worker, 30)
        assert code == 0, output
    code, output = run.finish_coordinator(30)
    assert code == 0, output
    assert "finished after 4 epochs" in output
    assert output.count("refused worker") <= 20  # the log is rate-limited, not flooded
    assert "unreadable frames" in output
    assert sum(sent.values()) >= 2000, sent
    assert peak < 200_000, f"coordinator peak memory {peak} kB"  # python + zmq is ~40 MB
    print(f"fuzz volume {sent}, coordinator peak RSS {peak / 1024:.1f} MiB")

    for rank in (0, 1):
        a = torch.load(tmp_path / "ref-out" / f"rank{rank}.pt")
        b = torch.load(tmp_path / "out" / f"rank{rank}.pt")
        assert a["best_epoch"] == b["best_epoch"]
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), name
    spawn.assert_none_left()


def test_bomb_frames_leave_the_coordinator_small_and_the_run_finishing(spawn: Spawner):
    # 20 hellos at the size limit, each decoding to a multiple of its size with plain msgpack, from
    # 20 strangers (so no reply budget spares the decoder), while a real 2-worker run goes on
    run = standalone_run(spawn, *POLICY)
    run.wait_for_first_epoch()
    deadline = time.monotonic() + DEADLINE
    frame = bomb(MAX_FRAME_BYTES)
    assert len(frame) <= MAX_FRAME_BYTES
    ctx = zmq.Context()
    socks = []
    try:
        for i in range(20):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"bomber-{i}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(run.endpoint)
            sock.send(frame)
            socks.append(sock)
        peak = 0
        while any(w.poll() is None for w in run.workers):
            peak = max(peak, peak_memory_kb(run.coordinator.pid))
            assert time.monotonic() < deadline, "the job did not finish"
            time.sleep(0.05)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    for worker in run.workers:
        code, output = spawn.finish(worker, 30)
        assert code == 0, output
    code, output = run.finish_coordinator(30)
    assert code == 0, output
    assert "finished after 4 epochs" in output
    assert "dropped 20 unreadable frames" in output
    assert peak < 300 * 1024, f"coordinator peak memory {peak / 1024:.0f} MiB"
    print(f"coordinator peak RSS with 20 bomb frames: {peak / 1024:.1f} MiB")
    spawn.assert_none_left()
