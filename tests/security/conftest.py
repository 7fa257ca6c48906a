"""Fixtures for the security tests: a key directory, ZeroMQ sockets that are always cleaned up,
and (from the integration tests) ``spawn`` for real runs.

Every socket a test opens through ``net`` is closed with ``linger=0`` and every authenticator
stopped at teardown, even when the test failed; a context that then will not terminate within
a deadline fails the test instead of hanging the run.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from epochal.security import KeyDirectory, generate
from tests.integration.conftest import spawn  # noqa: F401  (the real runs here use it)

TERM_DEADLINE = 5.0


class Net:
    """One zmq.asyncio context and everything opened in it during a test."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._sockets: list[zmq.Socket[Any]] = []
        self._authenticators: list[Any] = []

    def socket(self, kind: int, **options: Any) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        self._sockets.append(sock)
        return sock

    def monitor(self, sock: zmq.Socket[Any]) -> zmq.asyncio.Socket:
        """A monitor of ``sock``'s events; make it before connecting to see every event."""
        mon = sock.get_monitor_socket()
        self._sockets.append(mon)
        return mon

    def keep(self, authenticator: Any) -> Any:
        self._authenticators.append(authenticator)
        return authenticator

    def close(self) -> None:
        for auth in self._authenticators:
            auth.stop()
        for sock in reversed(self._sockets):
            sock.close(linger=0)
        done = threading.Event()

        def term() -> None:
            self.ctx.term()
            done.set()

        threading.Thread(target=term, daemon=True).start()
        if not done.wait(TERM_DEADLINE):
            pytest.fail(f"the ZeroMQ context did not terminate within {TERM_DEADLINE} s")


@pytest.fixture
async def net() -> AsyncIterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def keydir(tmp_path: Path) -> KeyDirectory:
    return generate(tmp_path / "keys", workers=2)
