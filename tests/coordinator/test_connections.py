"""The rules for the ROUTER's connections, on a clock the tests set: timeouts, the cap, a shortage
of descriptors; and the socket work that carries a drop out, on real sockets."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket

import pytest
import zmq

from epochal.coordinator.rules.holding import Held
from epochal.coordinator.serve import oslimits
from epochal.coordinator.serve.connections import (
    CONNECTION_BYTES,
    NOTHING,
    UNADMITTED_BYTES,
    Connections,
    Drop,
    connection_limits,
)
from epochal.coordinator.serve.guard import Scratch, inode_of, shut
from epochal.coordinator.serve.oslimits import AcceptFailures, files_needed

TIMEOUT = 15.0


def table(*, cap_files: int | None = None, workers: int = 2, frame: int = 64 * 1024):
    """A table whose cap comes from ``cap_files`` descriptors left (None: from memory)."""
    files = None if cap_files is None else cap_files + files_needed(workers)
    limits = connection_limits(workers=workers, timeout=TIMEOUT, frame_bytes=frame, files=files)
    return Connections(limits, AcceptFailures(workers))


@pytest.mark.parametrize(
    ("workers", "frame", "files", "cap"),
    [
        # memory: 128 MiB at (frame + CONNECTION_BYTES) each
        (2, 64 * 1024, None, UNADMITTED_BYTES // (64 * 1024 + CONNECTION_BYTES)),
        (2, 16 * 1024 * 1024, None, UNADMITTED_BYTES // (16 * 1024 * 1024 + CONNECTION_BYTES)),
        # descriptors: what the workers and the coordinator leave of the limit
        (2, 64 * 1024, 1024, 1024 - files_needed(2)),
        (2, 64 * 1024, 10**6, UNADMITTED_BYTES // (64 * 1024 + CONNECTION_BYTES)),
        # never below the workers, which may all connect at once
        (4096, 64 * 1024, 10**6, 4096),
        (2000, 64 * 1024, 1024, 2000),
    ],
)
def test_the_cap_is_the_smaller_of_memory_and_descriptors_but_never_below_the_workers(
    workers, frame, files, cap
):
    limits = connection_limits(workers=workers, timeout=TIMEOUT, frame_bytes=frame, files=files)
    assert limits.cap == cap
    assert limits.timeout == TIMEOUT


def test_a_connection_that_never_joins_is_dropped_after_the_timeout():
    t = table()
    assert t.accepted(100.0, 7, inode=70).drops == ()
    assert t.accepted(101.0, 8, inode=80).drops == ()
    assert t.expired(100.0 + TIMEOUT - 0.01).drops == ()
    assert t.expired(100.0 + TIMEOUT).drops == (Drop(7, 70, "timeout"),)
    assert t.expired(100.0 + TIMEOUT).drops == ()  # dropped once
    assert t.expired(101.0 + TIMEOUT).drops == (Drop(8, 80, "timeout"),)
    assert t.pending == 0 and t.held == 2  # shut down, not closed yet
    t.closed(7)
    t.closed(8)
    assert t.held == 0
    assert t.dropped["timeout"] == 2


def test_a_members_connection_is_never_dropped():
    t = table(cap_files=3)
    t.accepted(0.0, 5, inode=50)
    t.admitted(5, 50)  # a member's frame came on it
    for fd in range(10, 20):  # strangers, past the cap
        for drop in t.accepted(1.0, fd, inode=fd * 10).drops:
            assert drop.fd != 5
    assert all(d.fd != 5 for d in t.expired(1000.0).drops)
    assert all(d.fd != 5 for d in t.accept_failed(1000.0, errno.EMFILE).drops)


def test_a_members_frame_read_before_the_monitor_said_accepted_still_counts():
    t = table()
    t.admitted(5, 50)  # the frame first
    t.accepted(0.0, 5, inode=50)  # then the event, for the same socket
    assert t.pending == 0
    assert t.expired(TIMEOUT * 10).drops == ()


def test_a_descriptor_reused_for_a_new_connection_is_a_new_connection():
    t = table()
    t.accepted(0.0, 5, inode=50)
    t.admitted(5, 50)
    t.accepted(1.0, 5, inode=51)  # libzmq closed 5 (its event lost) and a stranger got it
    assert t.expired(1.0 + TIMEOUT).drops == (Drop(5, 51, "timeout"),)
    t.closed(5)
    assert t.accepted(2.0, 5, inode=None) == t.accepted(2.0, 5, inode=None)  # gone already
    assert t.pending == 0


def test_past_the_cap_the_oldest_is_dropped_and_said_once():
    t = table(cap_files=3)
    for fd in (1, 2, 3):
        assert t.accepted(float(fd), fd, inode=fd).drops == ()
    verdict = t.accepted(4.0, 4, inode=4)
    assert verdict.drops == (Drop(1, 1, "cap"),)  # the oldest, not the newest
    (line,) = verdict.lines
    assert "more than 3 connections are open from peers that have not joined" in line
    assert f"the open-files limit ({3 + files_needed(2)})" in line
    later = t.accepted(5.0, 5, inode=5)
    assert later.drops == (Drop(2, 2, "cap"),) and later.lines == ()
    assert t.pending == 3 and t.dropped["cap"] == 2


def test_out_of_descriptors_the_oldest_stranger_makes_room_one_at_a_time(monkeypatch):
    monkeypatch.setattr(oslimits.resource, "getrlimit", lambda which: (1024, 1024))
    t = table()
    for fd in (1, 2, 3):
        t.accepted(float(fd), fd, inode=fd)
    first = t.accept_failed(4.0, errno.EMFILE)
    assert first.drops == (Drop(1, 1, "files"),)
    (line,) = first.lines
    assert "too many open files (the open-files limit is 1024" in line
    assert "3 connections are held by peers that have not joined the run" in line
    assert "ulimit" not in line  # the 2 workers are not the cause
    # libzmq retries the accept at every turn: a flood of failures, one drop until it closed
    assert all(t.accept_failed(4.0, errno.EMFILE).drops == () for _ in range(100))
    assert t.accept_failed(4.0, errno.ENFILE).drops == ()  # the system's limit: the same
    t.closed(1)
    again = t.accept_failed(5.0, errno.EMFILE)
    assert again.drops == (Drop(2, 2, "files"),) and again.lines == ()
    assert t.failures.too_many_files == 103


def test_a_shortage_already_named_by_the_cap_is_not_said_again():
    t = table(cap_files=2)
    for fd in (1, 2, 3):
        t.accepted(float(fd), fd, inode=fd)  # the cap's line: the open-files limit
    assert t.accept_failed(4.0, errno.EMFILE).lines == ()


def test_other_accept_failures_are_named_once_per_cause():
    t = table()
    (line,) = t.accept_failed(0.0, errno.ENOBUFS).lines
    assert "ENOBUFS" in line
    assert t.accept_failed(0.0, errno.ENOBUFS).lines == ()
    assert t.accept_failed(0.0, errno.ECONNABORTED).lines != ()
    assert t.failures.total == 3 and t.failures.too_many_files == 0


def test_time_the_service_lost_counts_for_no_connection():
    t = table()
    t.accepted(0.0, 1, inode=1)
    t.forgive(100.0)  # the coordinator was stopped for 100 s
    assert t.expired(TIMEOUT + 50).drops == ()
    assert t.expired(TIMEOUT + 100).drops == (Drop(1, 1, "timeout"),)


def test_a_drop_that_found_another_socket_frees_the_way_for_the_next():
    t = table()
    for fd in (1, 2):
        t.accepted(0.0, fd, inode=fd)
    (drop,) = t.accept_failed(0.0, errno.EMFILE).drops
    t.gone(drop.fd)  # its descriptor was another socket already: nothing was freed
    assert t.accept_failed(0.0, errno.EMFILE).drops == (Drop(2, 2, "files"),)


def test_a_drop_libzmq_never_confirms_is_forgotten_after_the_timeout():
    t = table()
    t.accepted(0.0, 1, inode=1)
    t.expired(TIMEOUT)
    assert t.held == 1
    t.expired(2 * TIMEOUT)
    assert t.held == 0


def test_the_summary_counts_each_kind_of_drop():
    t = table(cap_files=1, workers=1)
    assert t.summary() is None
    t.accepted(0.0, 1, inode=1)
    t.accepted(0.0, 2, inode=2)
    t.expired(TIMEOUT)
    summary = t.summary()
    assert summary is not None
    assert "1 connections that did not join within 15 s, 1 past the cap of 1" in summary


# ---------------------------------------------------------------------- the socket work


def test_shut_ends_the_connection_for_both_ends_and_leaves_the_descriptor_open():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    scratch = Scratch()
    try:
        fd, port = served.fileno(), listener.getsockname()[1]
        inode = inode_of(fd)
        assert inode is not None
        assert not shut(Drop(fd, inode + 1, "timeout"), port, scratch)  # another socket
        assert not shut(Drop(fd, inode, "timeout"), port + 1, scratch)  # another port
        assert shut(Drop(fd, inode, "timeout"), port, scratch)
        assert client.recv(1) == b""  # the peer sees the end
        assert served.recv(1) == b""  # so does the descriptor's owner, which still holds it
        assert os.fstat(fd) is not None
        assert inode_of(scratch.slot) is None  # the slot holds /dev/null again
    finally:
        scratch.close()
        for sock in (client, served, listener):
            sock.close()


def test_shut_works_with_no_descriptor_left_to_open():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    scratch = Scratch()
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, before[1]))
        with pytest.raises(OSError) as full:
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        assert full.value.errno == errno.EMFILE
        inode = inode_of(served.fileno())
        assert inode is not None
        port = listener.getsockname()[1]
        assert shut(Drop(served.fileno(), inode, "files"), port, scratch)
        assert client.recv(1) == b""
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
        scratch.close()
        for sock in (client, served, listener):
            sock.close()


def test_a_closed_descriptor_or_a_file_is_never_shut():
    scratch = Scratch()
    try:
        with open(os.devnull, "rb") as handle:
            assert inode_of(handle.fileno()) is None  # not a socket
            drop = Drop(handle.fileno(), os.fstat(handle.fileno()).st_ino, "timeout")
            assert not shut(drop, None, scratch)
        assert not shut(drop, None, scratch)  # closed now
    finally:
        scratch.close()


def test_libzmq_closes_a_connection_shut_through_its_descriptor():
    """The drop as the coordinator makes it: the monitor names the descriptor, the shutdown goes
    through a duplicate, libzmq's I/O thread reads end of file, closes it and says so."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    scratch = Scratch()
    try:
        router.bind("tcp://127.0.0.1:0")
        port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        client = socket.create_connection(("127.0.0.1", port))
        from zmq.utils.monitor import parse_monitor_message

        assert monitor.poll(10_000)
        accepted = parse_monitor_message(monitor.recv_multipart())
        assert accepted["event"] == zmq.EVENT_ACCEPTED
        fd = int(accepted["value"])
        inode = inode_of(fd)
        assert inode is not None
        assert shut(Drop(fd, inode, "timeout"), port, scratch)
        assert monitor.poll(10_000)
        closed = parse_monitor_message(monitor.recv_multipart())
        assert closed["event"] == zmq.EVENT_DISCONNECTED and int(closed["value"]) == fd
        client.settimeout(10)
        try:
            with contextlib.suppress(ConnectionResetError):
                while client.recv(4096):  # libzmq's greeting, then the end
                    pass
            # libzmq's close reset the connection (it lingers not): a peer still sending is told
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                client.send(b"x")
        finally:
            client.close()
    finally:
        scratch.close()
        router.disable_monitor()
        monitor.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_a_rendezvous_timeout_names_the_strangers_that_held_the_descriptors(monkeypatch):
    monkeypatch.setattr(oslimits.resource, "getrlimit", lambda which: (1024, 1024))
    t = table()
    assert t.rendezvous_note() == ""
    for fd in range(3):
        t.accepted(0.0, fd, inode=fd)
    t.accept_failed(0.0, errno.EMFILE)
    note = t.rendezvous_note()
    assert "3 of them were held by peers that had not joined the run" in note
    assert "ulimit" not in note


def test_a_connection_holding_an_unfinished_message_is_dropped_a_members_too_said_once():
    t = table()
    t.accepted(0.0, 5, inode=50)
    t.admitted(5, 50)  # a member's
    t.accepted(0.0, 6, inode=60)  # a stranger's
    t.accepted(0.0, 7, inode=70)
    assert sorted(t.everyone()) == [5, 6, 7] and t.strangers() == [6, 7]
    verdict = t.holding(1.0, [Held(5, 300_000), Held(6, 200_000)], limit=140_000)
    assert verdict.drops == (Drop(5, 50, "holding"), Drop(6, 60, "holding"))
    assert len(verdict.lines) == 1
    assert "held 293 KiB of a message it had not finished" in verdict.lines[0]
    assert "more than 137 KiB" in verdict.lines[0]
    assert not t.knows(5) and t.everyone() == [7]
    assert t.holding(1.0, [Held(5, 300_000)], limit=140_000) == NOTHING  # being dropped
    again = t.holding(2.0, [Held(7, 200_000)], limit=140_000)
    assert again.drops == (Drop(7, 70, "holding"),) and again.lines == ()  # said once
    assert t.held == 3  # shut down, not closed yet
    for fd in (5, 6, 7):
        t.closed(fd)
    assert t.held == 0 and t.dropped["holding"] == 3
    summary = t.summary()
    assert summary is not None and "3 that held an unfinished message" in summary
