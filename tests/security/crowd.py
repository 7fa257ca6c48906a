"""Many raw TCP connections to a coordinator, held the way a stranger would hold them.

A :class:`Crowd` opens connections that finish ZeroMQ's handshake by hand (ZMTP 3.0, the NULL
mechanism, as a DEALER) and then say nothing, or send all of one frame but its last byte, and
watches which of them the coordinator closes. It speaks raw ZMTP so that nothing in it answers
for it (a ZeroMQ socket would reconnect, and answer heartbeats), and uses ``poll`` so that it is
not limited to 1,024 descriptors; :func:`own_files` raises this process's own open-files limit
for it.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

GREETING = (
    b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
)
"""ZMTP 3.0's greeting: signature, version 3.0, the NULL mechanism, as-server 0, filler."""


def _ready() -> bytes:
    body = b"\x05READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
    return bytes([0x04, len(body)]) + body  # a short command frame


HANDSHAKE = GREETING + _ready()


def frame_head(size: int) -> bytes:
    """The head of a long, last message frame of ``size`` bytes."""
    return b"\x02" + struct.pack(">Q", size)


@contextmanager
def own_files(needed: int) -> Iterator[None]:
    """This process may open at least ``needed`` files while inside (skip where it may not)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = before
    if soft == resource.RLIM_INFINITY or soft >= needed:
        yield
        return
    try:
        new_hard = hard if hard == resource.RLIM_INFINITY else max(hard, needed)
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, new_hard))
    except (ValueError, OSError):
        pytest.skip(f"needs {needed} open files; the hard limit is {hard}")
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


class Crowd:
    """Connections to one endpoint; the time each was opened and the time it was seen closed."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.address = (host, int(port))
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        self.closed: dict[int, float] = {}  # index -> when seen closed
        self._unsent: dict[int, int] = {}  # index -> bytes of the payload sent so far
        self._payload = memoryview(b"")
        self._poll = select.poll()
        self._by_fd: dict[int, int] = {}

    def open(self, count: int, *, handshake: bool = True, deadline: float = 60.0) -> None:
        """Open ``count`` more connections at once; with ``handshake``, finish ZMTP's as a
        DEALER. Fails if they are not all connected within ``deadline`` seconds."""
        first = len(self.socks)
        connecting: dict[int, int] = {}
        waiting = select.poll()
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            index = len(self.socks)
            self.socks.append(sock)
            self.opened.append(time.monotonic())  # before: the coordinator's clock starts later
            code = sock.connect_ex(self.address)
            assert code in (0, errno.EINPROGRESS), os.strerror(code)
            connecting[sock.fileno()] = index
            waiting.register(sock, select.POLLOUT)
        end = time.monotonic() + deadline
        while connecting:
            assert time.monotonic() < end, f"{len(connecting)} connections not made in time"
            for fd, _events in waiting.poll(100):
                index = connecting.pop(fd)
                waiting.unregister(fd)
                sock = self.socks[index]
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                assert code == 0, f"connection {index} failed: {os.strerror(code)}"
                if handshake:
                    sock.send(HANDSHAKE)  # 74 bytes into an empty buffer: all of it
                self._by_fd[fd] = index
                self._poll.register(sock, select.POLLIN | select.POLLRDHUP)
        assert len(self.socks) == first + count

    def send_partial(self, first: int, frame_bytes: int) -> None:
        """Queue on connections ``first`` onward one frame of ``frame_bytes``, but its last byte."""
        if len(self._payload) != len(frame_head(0)) + frame_bytes - 1:
            self._payload = memoryview(frame_head(frame_bytes) + bytes(frame_bytes - 1))
        for index in range(first, len(self.socks)):
            if index not in self.closed:
                self._unsent[index] = 0

    @property
    def sending(self) -> int:
        return len(self._unsent)

    @property
    def open_count(self) -> int:
        return len(self.socks) - len(self.closed)

    def pump(self, timeout: float) -> None:
        """Send what is queued where the connection takes it, and note the closed connections,
        for at most ``timeout`` seconds (less once nothing is left to send)."""
        payload = self._payload
        for index, done in list(self._unsent.items()):
            try:
                sent = self.socks[index].send(payload[done : done + (1 << 20)])
            except BlockingIOError:
                continue
            except OSError:  # reset or shut down by the coordinator
                self._close(index)
                continue
            if done + sent == len(payload):
                del self._unsent[index]
            else:
                self._unsent[index] = done + sent
        for fd, _events in self._poll.poll(0 if self._unsent else timeout * 1000):
            index = self._by_fd[fd]
            self._drain(index)

    def _drain(self, index: int) -> None:
        sock = self.socks[index]
        while True:
            try:
                if not sock.recv(65536):  # what the coordinator says (its greeting), then EOF
                    self._close(index)
                    return
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                    self._close(index)
                    return
                raise

    def _close(self, index: int) -> None:
        if index in self.closed:
            return
        self.closed[index] = time.monotonic()
        self._unsent.pop(index, None)
        sock = self.socks[index]
        # a connection still being made when open() failed was never registered: closed all the
        # same, so that the failure is the one reported and no socket outlives the test
        if self._by_fd.pop(sock.fileno(), None) is not None:
            self._poll.unregister(sock)
        sock.close()

    def wait(self, until: float, *, all_closed: bool = False, sent: bool = False) -> None:
        """Pump until monotonic ``until``, or sooner: every connection closed (``all_closed``),
        or everything sent or closed (``sent``)."""
        while time.monotonic() < until:
            if all_closed and self.open_count == 0:
                return
            if sent and not self._unsent:
                return
            self.pump(min(0.1, max(until - time.monotonic(), 0)))

    def close(self) -> None:
        for index in range(len(self.socks)):
            self._close(index)


def zmtp_dealer(endpoint: str) -> socket.socket:
    """A raw TCP connection that completes the ZMTP 3.0 handshake as a DEALER (NULL mechanism),
    so that what it sends next is read as a message frame."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)

    def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "the coordinator closed the connection during the handshake"
            data += chunk
        return data

    read(64)  # its greeting
    body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    conn.sendall(b"\x04" + bytes([len(body)]) + body)
    flags = read(1)[0]  # its READY
    read(int.from_bytes(read(8 if flags & 0x02 else 1), "big"))
    return conn
