"""What the connection guard relies on of Linux and glibc, each failing by the name of the thing
that changed (:mod:`epochal.coordinator.serve.kernel`)."""

from __future__ import annotations

import socket
import sys

import pytest

from epochal.coordinator.serve import kernel
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux's TCP_INFO and /proc")

SETTLE = 5.0
"""Seconds the loopback may take to deliver a few bytes (a deadline, not a wait)."""


def _connected() -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    return listener, client, served


def _unread(sock: socket.socket, count: int) -> None:
    """Wait until ``count`` bytes sit unread in ``sock``'s receive queue."""
    wait_until(
        lambda: len(sock.recv(count, socket.MSG_PEEK | socket.MSG_DONTWAIT)) >= count,
        SETTLE,
        "the bytes never came",
        interval=0.01,
    )


def test_bytes_read_counts_what_was_read_not_what_waits_unread():
    listener, client, served = _connected()
    try:
        info = served.getsockopt(socket.IPPROTO_TCP, kernel.TCP_INFO, kernel.TCP_INFO_BYTES)
        assert len(info) >= kernel.BYTES_RECEIVED_AT + 8, (
            f"struct tcp_info is {len(info)} bytes: this kernel has no tcpi_bytes_received "
            "(Linux 4.1 and later)"
        )
        assert kernel.bytes_read(served.fileno()) == 0
        client.sendall(b"x" * 1000)
        _unread(served, 1000)
        assert kernel.bytes_read(served.fileno()) == 0, (
            "the bytes unread (ioctl SIOCINQ) are not subtracted from tcpi_bytes_received: "
            "its offset in struct tcp_info changed, or SIOCINQ did"
        )
        served.recv(300)
        assert kernel.bytes_read(served.fileno()) == 300, "tcpi_bytes_received is not at offset 128"
    finally:
        for sock in (client, served, listener):
            sock.close()


def test_bytes_read_of_what_is_not_a_connected_tcp_socket_is_none(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with open(tmp_path / "f", "w") as handle:
            assert kernel.bytes_read(handle.fileno()) is None
        assert kernel.bytes_read(udp.fileno()) is None
        closed = socket.socket()
        fd = closed.fileno()
        closed.close()
        assert kernel.bytes_read(fd) is None
    finally:
        udp.close()
        listener.close()


def test_resident_memory_is_read_and_grows_with_what_is_touched():
    resident = kernel.Resident()
    try:
        before = resident.bytes()
        assert before is not None, "/proc/self/statm is not readable"
        block = bytearray(64 * 1024 * 1024)  # zeroed: every page touched
        after = resident.bytes()
        assert after is not None and after - before >= 48 * 1024 * 1024, (before, after)
        del block
    finally:
        resident.close()
    assert resident.bytes() is None  # closed


def test_freed_memory_can_be_given_back():
    assert kernel.give_back_memory(), "this C library has no malloc_trim (glibc's)"
