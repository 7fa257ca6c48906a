"""The coordinator's ROUTER socket, made and bound with every option it needs, in the right order.

Options that libzmq reads at ``listen()`` (the backlog) or at each connection (the largest frame,
the receive queue, the handshake deadline the connection guard sets) are set before the bind; the
monitor that reports accepted and closed connections is attached before the bind too, so it misses
none; under CURVE the ZAP authenticator runs before the bind, so nobody slips in unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from epochal.coordinator.serve import oslimits
from epochal.coordinator.serve.guard import EVENTS, ConnectionGuard
from epochal.protocol import MAX_FRAME_BYTES
from epochal.security.curvekeys import ServerSecurity, secure_server

RECEIVE_HWM = 64
"""Frames queued per peer before libzmq drops more: bounds what one peer can make us hold."""

LINGER_MS = 2000
"""How long closing the socket may wait to flush the last Abort or Finish."""


def open_router(
    context: zmq.asyncio.Context,
    bind: str,
    *,
    workers: int,
    guard: ConnectionGuard,
    monitor: oslimits.AcceptMonitor,
    security: ServerSecurity | None,
    on_refused: Callable[..., Any] | None,
) -> tuple[zmq.asyncio.Socket, Any]:
    """The ROUTER bound to ``bind``, and its authenticator (None without ``security``); on an
    error nothing is left open. Raises OSError naming the address when it cannot bind."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    # a peer announcing a larger frame is disconnected before libzmq holds any of it
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
    oslimits.configure_router(sock, workers)  # before bind: libzmq applies it at listen()
    guard.configure(sock)
    monitor.watch(sock, EVENTS)
    auth = None
    if security is not None:
        try:  # the authenticator runs before the socket binds: nobody slips in unchecked
            auth = secure_server(context, sock, security, on_refused=on_refused)
        except BaseException:
            monitor.close(sock)
            sock.close(linger=0)
            raise
    try:
        sock.bind(bind)
    except zmq.ZMQError as exc:
        monitor.close(sock)
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        raise OSError(f"cannot bind the coordinator to {bind}: {exc}") from None
    return sock, auth
