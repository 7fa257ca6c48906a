"""What anyone who reaches ``--metrics-address`` can make the coordinator hold: bounded.

The metrics endpoint listens where the user asks, often beyond loopback for a Prometheus server on
another machine, and asks for no credentials. prometheus-client's own server started a thread per
connection and held it as long as the peer stayed silent; these tests open real connections
against a real :class:`~epochal.observe.prometheus.Prometheus` and count the threads.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from epochal.observe.metricsserver import MAX_CONNECTIONS, MetricsServer
from epochal.observe.prometheus import Prometheus

IDLE = 200
MARGIN = 10.0
"""Seconds added to a configured timeout for a loaded machine to act on it."""


@pytest.fixture
def metrics() -> Iterator[Prometheus]:
    served = Prometheus("127.0.0.1:0")
    try:
        yield served
    finally:
        served.close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=MARGIN) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def test_idle_connections_hold_no_thread_each_and_metrics_still_answer(metrics: Prometheus):
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", metrics.port)) for _ in range(IDLE)]
    try:
        status, text = get(metrics.url)  # past the bound, the longest idle makes room
        assert status == 200 and "epochal_workers_joined" in text
        assert threading.active_count() <= before, "a thread per connection"
        dropped = 0
        for sock in idle:  # at most MAX_CONNECTIONS are held: the others were closed
            sock.settimeout(MARGIN)
            try:
                dropped += sock.recv(1) == b""
            except TimeoutError:
                pass
            except ConnectionResetError:
                dropped += 1
            if dropped >= IDLE - MAX_CONNECTIONS:
                break
        assert dropped >= IDLE - MAX_CONNECTIONS
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("path", ["/", "/metricsx", "/favicon.ico", "/metrics/../x", "/debug"])
def test_only_metrics_is_served(metrics: Prometheus, path: str):
    status, text = get(f"http://127.0.0.1:{metrics.port}{path}")
    assert status == 404 and "only /metrics" in text
    assert get(f"http://127.0.0.1:{metrics.port}/metrics?name[]=epochal_epoch")[0] == 200
    request = urllib.request.Request(metrics.url, data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=MARGIN)
    with info.value:
        assert info.value.code == 405


def test_an_idle_or_slow_connection_is_held_no_longer_than_the_timeout():
    server = MetricsServer("127.0.0.1", 0, lambda: (b"x 1\n", "text/plain"), timeout=0.5)
    try:
        silent = socket.create_connection(("127.0.0.1", server.port))
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")  # a head that never ends
        for sock in (silent, slow):
            sock.settimeout(0.5 + MARGIN)
            started = time.monotonic()
            assert sock.recv(1) == b"", "the connection was not closed"
            assert time.monotonic() - started < 0.5 + MARGIN
            sock.close()
    finally:
        server.close()


def test_a_request_head_past_the_bound_is_refused():
    server = MetricsServer("127.0.0.1", 0, lambda: (b"x 1\n", "text/plain"))
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.settimeout(MARGIN)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n")
            assert sock.recv(64).startswith(b"HTTP/1.1 431 ")
    finally:
        server.close()
