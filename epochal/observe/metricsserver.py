"""A small HTTP server for ``GET /metrics`` whose cost to whoever connects is bounded.

prometheus-client's own ``start_http_server`` is a ``ThreadingWSGIServer``: one thread per
connection, with no limit on connections and no timeout on reading a request, so every idle
connection holds a thread for as long as its peer keeps it open, and it answers every path. Its
server cannot be given either bound, so this one serves the same text
(``prometheus_client.generate_latest``) with them:

- one thread, an asyncio loop, for every connection (none is started per connection);
- at most :data:`MAX_CONNECTIONS` held at once: past that, the connection held longest without a
  complete request is closed to make room, so a scraper is answered however many idle
  connections others open;
- each connection is held at most :data:`CONNECTION_TIMEOUT` seconds, from its accept to the
  last byte of the answer (an idle or slow peer is dropped), and its request head may be at most
  :data:`MAX_REQUEST_BYTES`;
- ``/metrics`` (and ``/metrics?...``) only: any other path is 404, any method but GET 405; one
  request per connection (``Connection: close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future

MAX_CONNECTIONS = 64
"""Connections held at once; a Prometheus server scrapes with one at a time."""

CONNECTION_TIMEOUT = 10.0
"""Seconds a connection is held at most, reading its request and writing the answer included
(Prometheus' default scrape timeout is 10 s)."""

MAX_REQUEST_BYTES = 8 * 1024
"""Longest request head (request line and headers) read; a longer one is answered 431."""

PATH = "/metrics"

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
}


class MetricsServer:
    """Serves ``render()``'s bytes at ``http://host:port/metrics`` from construction until
    :meth:`close`; ``port`` is the bound port. OSError when the address cannot be bound."""

    def __init__(
        self,
        host: str,
        port: int,
        render: Callable[[], tuple[bytes, str]],
        *,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = CONNECTION_TIMEOUT,
    ) -> None:
        self._render = render
        # the body and its content type, made on the server's thread for each request
        self._max = max_connections
        self._timeout = timeout
        self._reading: dict[asyncio.Task[None], None] = {}
        # connections still reading their request, the longest held first
        self._tasks: set[asyncio.Task[None]] = set()
        # bound here, not by asyncio, whose name lookup would start an executor thread
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.create_server(address[:2], family=family)
        self.port: int = listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="epochal-metrics", daemon=True
        )
        self._thread.start()
        started: Future[asyncio.Server] = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, sock=listener, limit=MAX_REQUEST_BYTES), self._loop
        )
        try:
            self._server = started.result()
        except BaseException:
            listener.close()
            self._stop_loop()
            raise

    # ------------------------------------------------------------------ one connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._reading[task] = None
        while len(self._tasks) > self._max and self._reading:
            oldest = next(iter(self._reading))
            self._reading.pop(oldest)
            self._tasks.discard(oldest)  # no longer held: it closes its connection as it ends
            oldest.cancel()
        try:
            async with asyncio.timeout(self._timeout):
                status, body, kind = await self._answer(reader, task)
                head = (
                    f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                    f"Content-Type: {kind}\r\n"
                    f"Content-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n"
                )
                writer.write(head.encode("ascii") + body)
                writer.close()  # once every byte is sent
                await writer.wait_closed()
        except (TimeoutError, asyncio.CancelledError, ConnectionError):
            pass  # dropped: idle, slow, made room for another, or gone
        finally:
            self._reading.pop(task, None)
            self._tasks.discard(task)
            writer.transport.abort()  # at once, whatever is unsent: nothing lingers

    async def _answer(
        self, reader: asyncio.StreamReader, task: asyncio.Task[None]
    ) -> tuple[int, bytes, str]:
        """(status, body, content type) for the request ``reader`` holds."""
        text = "text/plain; charset=utf-8"
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return 431, b"request head too large\n", text
        except asyncio.IncompleteReadError:
            return 400, b"incomplete request\n", text
        finally:
            self._reading.pop(task, None)  # from here on it is answered, not evicted
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"not an HTTP request\n", text
        method, target = parts[0], parts[1]
        if target.split(b"?", 1)[0] != PATH.encode():
            return 404, f"only {PATH} is served here\n".encode(), text
        if method != b"GET":
            return 405, b"only GET\n", text
        body, kind = self._render()
        return 200, body, kind

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop listening, drop every connection and end the thread (idempotent)."""
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result()
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
