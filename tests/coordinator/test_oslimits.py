"""The coordinator's operating-system limits: the open-files limit, the listen backlog, EMFILE."""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from epochal import nofile as nofile_module
from epochal.coordinator.serve.oslimits import (
    FILES_RESERVED,
    MIN_BACKLOG,
    MONITOR_BATCH,
    AcceptFailures,
    AcceptMonitor,
    backlog_for,
    backlog_note,
    configure_router,
    files_needed,
    files_shortage_message,
    is_too_many_files,
    nofile_note,
    too_many_files_message,
)
from epochal.nofile import raise_nofile_limit


@pytest.fixture
def nofile() -> Iterator[tuple[int, int]]:
    """The limit as it is; put back after the test (raising the soft limit needs no privilege)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield before
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_soft_limit_is_raised_to_the_hard_limit(nofile):
    _soft, hard = nofile
    if hard == resource.RLIM_INFINITY or hard < 300:
        pytest.skip(f"needs a finite hard limit above 300, this process has {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    assert raise_nofile_limit() == (256, hard)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)


def test_a_limit_already_at_the_hard_limit_is_left_alone(nofile):
    _soft, hard = nofile
    if hard == resource.RLIM_INFINITY:
        pytest.skip("the hard limit is unlimited here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    assert raise_nofile_limit() == (hard, hard)


class _FakeLimits:
    """resource's getrlimit/setrlimit for RLIMIT_NOFILE, on values a test chooses."""

    def __init__(self, soft: int, hard: int, *, refuse: bool = False) -> None:
        self.limits = (soft, hard)
        self.refuse = refuse

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        if self.refuse:
            raise ValueError("not allowed to raise maximum limit")
        self.limits = limits


def test_an_unlimited_hard_limit_raises_the_soft_limit_to_the_system_maximum(monkeypatch, tmp_path):
    fake = _FakeLimits(1024, resource.RLIM_INFINITY)
    monkeypatch.setattr(nofile_module.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(nofile_module.resource, "setrlimit", fake.setrlimit)
    nr_open = tmp_path / "nr_open"
    nr_open.write_text("1048576\n")
    monkeypatch.setattr(nofile_module, "NR_OPEN_PATH", nr_open)
    assert raise_nofile_limit() == (1024, 1048576)
    monkeypatch.setattr(nofile_module, "NR_OPEN_PATH", tmp_path / "absent")
    fake.limits = (256, resource.RLIM_INFINITY)
    assert raise_nofile_limit() == (256, nofile_module.NOFILE_FALLBACK)


def test_a_refused_raise_keeps_the_limit(monkeypatch):
    fake = _FakeLimits(1024, 4096, refuse=True)
    monkeypatch.setattr(nofile_module.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(nofile_module.resource, "setrlimit", fake.setrlimit)
    assert raise_nofile_limit() == (1024, 1024)
    assert fake.limits == (1024, 4096)


def test_a_limit_too_low_for_the_run_is_named_with_the_fix(monkeypatch):
    fake = _FakeLimits(1024, 1024)
    monkeypatch.setattr(nofile_module.resource, "getrlimit", fake.getrlimit)
    note = nofile_note(4096)
    assert note is not None
    assert "at most 1024 files" in note
    assert f"about {4096 + FILES_RESERVED}" in note
    assert f"ulimit -n {files_needed(4096)}" in note
    assert nofile_note(1024 - FILES_RESERVED) is None


def test_the_backlog_covers_every_worker_connecting_at_once():
    assert backlog_for(8) == MIN_BACKLOG
    assert backlog_for(4096) == 4096
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        assert sock.getsockopt(zmq.BACKLOG) == 100  # libzmq's default: what this fixes
        assert configure_router(sock, 4096) == 4096
        assert sock.getsockopt(zmq.BACKLOG) == 4096
        sock.bind("tcp://127.0.0.1:0")  # set before bind: the listen() call takes it
        sock.close(linger=0)
    finally:
        ctx.term()


def test_a_kernel_cap_below_the_run_is_noted():
    note = backlog_note(4096, somaxconn=128)
    assert note is not None
    assert "net.core.somaxconn" in note
    assert "sysctl -w net.core.somaxconn=4096" in note
    assert backlog_note(4096, somaxconn=4096) is None
    assert backlog_note(64, somaxconn=128) is None


def test_the_emfile_message_names_the_limit_and_how_to_raise_it(monkeypatch):
    fake = _FakeLimits(1024, 524288)
    monkeypatch.setattr(nofile_module.resource, "getrlimit", fake.getrlimit)
    line = too_many_files_message(4096)
    assert line.startswith("too many open files: the soft limit is 1024")
    assert "the hard limit is 524288" in line
    assert f"ulimit -n {files_needed(4096)}" in line
    assert "ulimit -n N" in too_many_files_message()


def test_emfile_and_enfile_are_too_many_files():
    assert is_too_many_files(OSError(errno.EMFILE, "Too many open files"))
    assert is_too_many_files(OSError(errno.ENFILE, "Too many open files in system"))
    assert not is_too_many_files(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_too_many_files(ValueError("EMFILE"))


def test_accept_failures_are_counted_and_other_causes_named_once(monkeypatch):
    fake = _FakeLimits(1024, 1024)
    monkeypatch.setattr(nofile_module.resource, "getrlimit", fake.getrlimit)
    failures = AcceptFailures(workers=1024)
    assert failures.rendezvous_note() == ""
    assert all(failures.note(errno.EMFILE) for _ in range(501))
    assert failures.note(errno.ENFILE)  # the system's limit: the same cause
    assert not failures.note(errno.ENOBUFS)
    other = failures.other_line(errno.ENOBUFS)
    assert other is not None and "ENOBUFS" in other
    assert failures.other_line(errno.ENOBUFS) is None
    assert failures.total == 503 and failures.too_many_files == 502
    note = failures.rendezvous_note()
    assert "502 times for want of file descriptors (soft limit 1024)" in note
    assert "not missing" in note


def test_the_rendezvous_note_blames_strangers_when_they_held_the_descriptors(monkeypatch):
    fake = _FakeLimits(1024, 1024)
    monkeypatch.setattr(nofile_module.resource, "getrlimit", fake.getrlimit)
    failures = AcceptFailures(workers=2)
    failures.note(errno.EMFILE)
    note = failures.rendezvous_note(held=958)
    assert "958 of them were held by peers that had not joined the run" in note
    assert "ulimit" not in note  # 2 workers fit in 1,024 files
    big = AcceptFailures(workers=2000)
    big.note(errno.EMFILE)
    assert "ulimit -n 2064" in big.rendezvous_note(held=10)


@pytest.mark.parametrize(
    ("workers", "held", "says", "advice"),
    [
        # strangers hold the descriptors: they are named, the workers are not blamed
        (2, 958, "958 connections are held by peers that have not joined the run", None),
        # the workers need more than the limit by themselves: the advice, with their need
        (2000, 0, "2000 workers need about 2064", "ulimit -n 2064"),
        (2000, 10, "and the 2000 workers need about 2064 by themselves", "ulimit -n 2064"),
        # neither: the descriptors are held elsewhere in the process
        (2, 0, "no peer that has not joined holds one", "ulimit -n N"),
    ],
)
def test_a_shortage_of_descriptors_names_who_holds_them(monkeypatch, workers, held, says, advice):
    fake = _FakeLimits(1024, 4096)
    monkeypatch.setattr(nofile_module.resource, "getrlimit", fake.getrlimit)
    line = files_shortage_message(workers, held=held)
    assert "the open-files limit is 1024, RLIMIT_NOFILE; the hard limit is 4096" in line
    assert says in line
    if advice is None:
        assert "ulimit" not in line
    else:
        assert advice in line


async def test_the_monitor_is_read_in_batches_that_let_the_loop_run():
    """libzmq retries an accept that failed for want of descriptors at every turn of its I/O
    thread, so the monitor pipe never empties: reading it must still let the event loop run the
    service's clock, heartbeats and timeouts (another task gets a turn every batch)."""
    ctx = zmq.asyncio.Context()
    pipe = ctx.socket(zmq.PAIR)  # the monitor's end of the pipe
    pipe.bind("inproc://monitor")
    stop = threading.Event()

    def io_thread() -> None:  # stands in for libzmq's: an event whenever there is room
        events: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)
        events.connect("inproc://monitor")
        failed = struct.pack("=hi", zmq.EVENT_ACCEPT_FAILED, errno.EMFILE)
        while not stop.is_set():
            try:
                events.send_multipart([failed, b"tcp://127.0.0.1:1"], zmq.NOBLOCK)
            except zmq.Again:
                stop.wait(0.0001)
        events.close(linger=0)

    feeder = threading.Thread(target=io_thread)
    feeder.start()
    monitor = AcceptMonitor()
    monitor._monitor = pipe
    wanted = 20 * MONITOR_BATCH
    turns = 0
    turns_seen: list[int] = []

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    def handle(event: int, value: int) -> None:
        assert (event, value) == (zmq.EVENT_ACCEPT_FAILED, errno.EMFILE)
        turns_seen.append(turns)

    ticker = asyncio.create_task(other())
    reader = asyncio.create_task(monitor.read(handle))
    try:
        while len(turns_seen) < wanted:
            await asyncio.sleep(0)
    finally:
        reader.cancel()
        ticker.cancel()
        await asyncio.gather(reader, ticker, return_exceptions=True)
        stop.set()
        feeder.join()
        pipe.close(linger=0)
        ctx.term()
    during = turns_seen[wanted - 1] - turns_seen[0]
    assert during >= wanted // MONITOR_BATCH - 1, f"{during} turns in {wanted} events"


_EMFILE_SERVER = textwrap.dedent(
    """
    import os, resource, sys, zmq
    from zmq.utils.monitor import parse_monitor_message
    from epochal.coordinator.serve.oslimits import AcceptFailures, configure_router
    from epochal.coordinator.serve.oslimits import files_shortage_message

    resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    configure_router(sock, 200)
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPT_FAILED)
    sock.bind("tcp://127.0.0.1:0")
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    failures = AcceptFailures(workers=200)
    while True:
        event = parse_monitor_message(monitor.recv_multipart())
        if failures.note(event["value"]):
            print(files_shortage_message(200, held=0), flush=True)
            break
    sys.stdin.read()  # until the test has made all its connections
    # libzmq queued far more failures than the monitor holds; closing would wait on that queue
    os._exit(0)
    """
)


def test_libzmq_reports_an_accept_that_ran_out_of_files_and_the_line_names_the_limit():
    """Connections beyond the open-files limit: libzmq says EMFILE only to a socket monitor."""
    server = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    clients: list[socket.socket] = []
    assert server.stdout is not None and server.stdin is not None
    try:
        endpoint = server.stdout.readline().strip()
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        for _ in range(80):  # more than 48 descriptors' worth
            clients.append(socket.create_connection((host, int(port)), timeout=10))
        line = server.stdout.readline()
    finally:
        # while they wait in the listen queue, libzmq retries them at every turn of its I/O thread
        for client in clients:
            client.close()
        server.stdin.close()
        assert server.wait(timeout=30) == 0
        server.stdout.close()
    assert "cannot accept a connection: too many open files" in line
    assert "the open-files limit is 48" in line
    assert f"ulimit -n {files_needed(200)}" in line


def test_the_monitor_never_holds_up_libzmq_however_far_its_reader_falls_behind():
    """Thousands of connections accepted and closed while nobody reads the monitor (its reader
    starved, or cancelled as a large run ends): libzmq's I/O thread goes on accepting (with a
    pipe of 1,000 messages it stopped after about 1,100 connections, holding the monitor's lock,
    and disabling the monitor then waited forever), and every event is there to read."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    monitor = AcceptMonitor()
    monitor.watch(router, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    try:
        for _ in range(2000):  # each accepted within the I/O thread's turn, none waits 10 s
            socket.create_connection(("127.0.0.1", port), timeout=10.0).close()
        closing = threading.Thread(target=monitor.close, args=(router,), daemon=True)
        closing.start()
        closing.join(60)  # a hang deadline: disabling takes milliseconds
        assert not closing.is_alive(), "disabling the monitor waited for libzmq's I/O thread"
    finally:
        router.close(linger=0)
        ctx.term()
