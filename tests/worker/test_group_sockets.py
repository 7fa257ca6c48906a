"""What :class:`~epochal.worker.dataplane.sockets.GroupSockets` notes while a group is made, and
what it shuts: only the new TCP connections to endpoints the process did not know before, so a
socket another thread opens meanwhile (a unix socket of an ``ipc://`` control connection, a
reconnection to the coordinator) is left alone. Real sockets on loopback, no process group.
"""

from __future__ import annotations

import socket
import sys

import pytest

from epochal.worker.dataplane import sockets
from epochal.worker.dataplane.sockets import GroupSockets, restore_excepthook

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/fd and /proc/self/net/tcp"
)


def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_only_new_tcp_connections_to_new_endpoints_are_noted_and_shut():
    known = listener()  # stands for the coordinator: connected to before the group is made
    first = socket.create_connection(known.getsockname())
    accepted_first, _ = known.accept()
    opened: list[socket.socket] = []

    def make() -> None:
        # what another thread may open meanwhile
        opened.extend(socket.socketpair())
        opened.append(socket.create_connection(known.getsockname()))  # a reconnection
        opened.append(known.accept()[0])
        # what the group opens: a listener of its own, a connection to a peer's and its accept
        peer = listener()
        opened.append(peer)
        opened.append(socket.create_connection(peer.getsockname()))
        opened.append(peer.accept()[0])

    try:
        _, noted = GroupSockets.opened_by(make)
        unix_a, unix_b, reconnected, reaccepted, _listener, to_peer, from_peer = opened
        assert set(noted.sockets) == {to_peer.fileno(), from_peer.fileno()}
        assert noted.shut() == 2
        assert to_peer.recv(1) == b""  # shut: end of stream
        # what was not the group's still works
        reconnected.sendall(b"x")
        assert reaccepted.recv(1) == b"x"
        unix_a.sendall(b"y")
        assert unix_b.recv(1) == b"y"
        first.sendall(b"z")
        assert accepted_first.recv(1) == b"z"
    finally:
        for sock in [*opened, first, accepted_first, known]:
            sock.close()


def test_leaving_puts_back_the_excepthook_the_group_wrapped(monkeypatch):
    def ours(*args: object) -> None:
        pass

    def groups(*args: object) -> None:
        pass

    monkeypatch.setattr(sys, "excepthook", ours)
    GroupSockets.opened_by(lambda: setattr(sys, "excepthook", groups))
    assert sys.excepthook is groups
    restore_excepthook()
    assert sys.excepthook is ours
    assert sockets._hook_before_group == []
    restore_excepthook()  # nothing noted: nothing changes
    assert sys.excepthook is ours
