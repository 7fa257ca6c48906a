"""The worker's end of the control plane's connection: a ZeroMQ DEALER socket, set up as the
control client needs it, and the monitor that reports its connection's events."""

from __future__ import annotations

import secrets

import zmq
import zmq.asyncio

from epochal.errors import EpochalError
from epochal.protocol import MAX_FRAME_BYTES
from epochal.security.curvekeys import ClientSecurity, secure_client

WATCHED_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
"""The connection's events the control client acts on."""

ROUTING_NONCE_BYTES = 8
"""Random bytes appended to the routing identity: another process cannot guess it and take over
this worker's connection (the coordinator hands an identity over to whoever connects with it)."""

LINGER_MS = 2000
"""Milliseconds a closing socket keeps trying to send what is queued (a last Failed, say)."""


class Dealer:
    """A DEALER socket connected to ``endpoint`` under ``identity`` (plus a random nonce):
    frames bounded by :data:`~epochal.protocol.MAX_FRAME_BYTES`, handshakes by
    ``handshake_timeout`` seconds; it reconnects after 0.1 s, then up to 2 s apart; CURVE when
    ``security`` is given. :attr:`monitor` receives its :data:`WATCHED_EVENTS`. Made on the
    thread that uses it."""

    def __init__(
        self,
        endpoint: str,
        identity: bytes,
        handshake_timeout: float,
        security: ClientSecurity | None,
    ) -> None:
        self.context = zmq.asyncio.Context()
        try:
            sock = self.context.socket(zmq.DEALER)
            nonce = b"#" + secrets.token_hex(ROUTING_NONCE_BYTES).encode()
            sock.setsockopt(zmq.IDENTITY, identity[: 255 - len(nonce)] + nonce)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            sock.setsockopt(zmq.HANDSHAKE_IVL, int(handshake_timeout * 1000))
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            if security is not None:
                secure_client(sock, security)  # a key libzmq refuses raises here
            self.socket = sock
            self.monitor = sock.get_monitor_socket(WATCHED_EVENTS)  # EMFILE, say
        except BaseException:
            # what was opened is closed here, not left to the garbage collector, which would find
            # the socket still open at some later point of the process (in a test process: its
            # ResourceWarning then fails whichever test is running)
            self.context.destroy(linger=0)
            raise
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close(linger=0)
            raise EpochalError(f"cannot connect to coordinator {endpoint!r}: {exc}") from None

    def close(self, linger: int = LINGER_MS) -> None:
        """Close the monitor at once and the socket after ``linger`` milliseconds at most; both
        are closed, and the context ended, even when stopping the monitor fails."""
        try:
            self.socket.disable_monitor()
        finally:
            self.monitor.close(linger=0)
            self.socket.close(linger=linger)
            self.context.term()
