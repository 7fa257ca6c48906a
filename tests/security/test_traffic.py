"""What someone who can read the control plane's traffic learns and can do, over real sockets.

A relay between a worker's DEALER and the coordinator's ROUTER keeps every byte that crosses it,
as a reader of the network path (or root on either machine) would. Without CURVE the job token
crosses in clear, so such a reader could join as a worker: docs/security.md says so, and the
first test shows it (and that the relay does see what crosses). Under CURVE the token never
appears, and the bytes the reader kept, sent again on a connection of its own, get nothing
through.
"""

from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING

import pytest
import zmq
import zmq.asyncio

from epochal.protocol import encode
from epochal.security import ClientSecurity, KeyDirectory, ServerSecurity, secure_client
from tests.conftest import hello
from tests.security.test_curve import (
    EVENT_DEADLINE,
    gets_through,
    secured_router,
)

if TYPE_CHECKING:
    from tests.security.conftest import Net

pytestmark = pytest.mark.timeout(30)

TOKEN = "token-the-reader-wants-7f3a9c"


class Relay:
    """A TCP relay on loopback that forwards one connection each way and keeps what it saw."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.upstream = bytearray()  # worker -> coordinator
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = [self._listener]
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        server = socket.create_connection(self._target)
        self._sockets += [client, server]
        for src, dst, kept in ((client, server, self.upstream), (server, client, None)):
            t = threading.Thread(target=self._pump, args=(src, dst, kept), daemon=True)
            t.start()
            self._threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, kept: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if kept is not None:
                    kept += data
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self._sockets:
            s.close()


async def send_hello_through_relay(
    net: Net, router: zmq.asyncio.Socket, target: str, security: ClientSecurity | None
) -> bytes:
    """A worker's hello with the token, sent through a relay to ``router`` and received there;
    returns every byte the relay saw going upstream."""
    relay = Relay(target)
    try:
        worker = net.socket(zmq.DEALER)
        if security is not None:
            secure_client(worker, security)
        worker.connect(relay.endpoint)
        frame = encode(hello(token=TOKEN))
        await worker.send(frame)
        assert await router.poll(int(EVENT_DEADLINE * 1000)), "the hello never arrived"
        received = await router.recv_multipart()
        assert received[-1] == frame
        return bytes(relay.upstream)
    finally:
        relay.close()


async def test_without_curve_a_traffic_reader_sees_the_token(net: Net) -> None:
    router = net.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    target = router.getsockopt_string(zmq.LAST_ENDPOINT)
    seen = await send_hello_through_relay(net, router, target, None)
    assert TOKEN.encode() in seen


async def test_under_curve_a_traffic_reader_neither_reads_nor_replays(
    net: Net, keydir: KeyDirectory
) -> None:
    security = ServerSecurity.from_paths(keydir.coordinator_secret, keydir.allowed)
    router, target = secured_router(net, security)
    worker = ClientSecurity.from_paths(keydir.worker_secrets["worker-0"], keydir.coordinator_public)
    seen = await send_hello_through_relay(net, router, target, worker)
    assert len(seen) > 200, "the relay saw no traffic: the test would prove nothing"
    assert TOKEN.encode() not in seen
    assert b"hello" not in seen and b"worker_id" not in seen

    # the reader replays the worker's bytes on a connection of its own
    host, port = target.removeprefix("tcp://").rsplit(":", 1)
    replay = socket.create_connection((host, int(port)))
    try:
        replay.settimeout(EVENT_DEADLINE)
        try:
            replay.sendall(seen)
        except OSError:
            pass  # the coordinator may close the connection before all of it is sent
        assert not await gets_through(router)
    finally:
        replay.close()
