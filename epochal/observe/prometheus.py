"""``--metrics-address HOST:PORT``: the run's metrics at ``http://HOST:PORT/metrics``.

The metrics live in a prometheus-client registry of its own (not the process-wide default, so
nothing else a process registers leaks in, and two coordinators in one process do not collide)
and are rendered by its ``generate_latest``; they are served on loopback unless a host is given,
by :class:`~epochal.observe.metricsserver.MetricsServer` rather than prometheus-client's own
``start_http_server``, which starts a thread per connection with no limit and no timeout and
answers every path (see that module for the bounds). No metric has per-rank labels: a run of
1,000 ranks is as many series as a run of two.
"""

from __future__ import annotations

import ipaddress
import math
import threading
from collections.abc import Mapping
from typing import Any

from epochal.errors import ConfigError
from epochal.observe.base import RunObserver, RunStart, StatusSnapshot, World
from epochal.observe.metricsserver import MetricsServer

DEFAULT_HOST = "127.0.0.1"

EPOCH_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, math.inf)
ROUND_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, math.inf)


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (loopback) -> (host, port); ConfigError else."""
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = DEFAULT_HOST, text
    host = host.removeprefix("[").removesuffix("]") or DEFAULT_HOST
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            f"--metrics-address needs HOST:PORT or PORT (got {text!r}): e.g. 127.0.0.1:9400, "
            "or 0.0.0.0:9400 for a scraper on another machine"
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Prometheus(RunObserver):
    """Serves the metrics from construction until :meth:`close`; ``port`` is the bound port."""

    def __init__(self, address: str) -> None:
        from prometheus_client import (
            CONTENT_TYPE_LATEST,
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            generate_latest,
        )

        self.host, port = parse_address(address)
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str, nan: bool = False) -> Gauge:
            g = Gauge(name, doc, registry=r)
            if nan:
                g.set(math.nan)  # no value yet, not a value of 0
            return g

        self.epoch = gauge("epochal_epoch", "The epoch being run, numbered from 0.")
        self.world_size = gauge("epochal_world_size", "Workers the run needs.")
        self.joined = gauge("epochal_workers_joined", "Workers that have joined.")
        self.train_loss = gauge("epochal_train_loss", "Last epoch's train loss.", nan=True)
        self.valid_loss = gauge(
            "epochal_valid_loss", "Last validated epoch's validation loss.", nan=True
        )
        self.smoothed_loss = gauge(
            "epochal_smoothed_loss", "The smoothed monitored loss after the last epoch.", nan=True
        )
        self.best_epoch = gauge("epochal_best_epoch", "The best epoch so far.", nan=True)
        self.epoch_seconds = Histogram(
            "epochal_epoch_seconds",
            "Seconds from an epoch's start to its decision.",
            buckets=EPOCH_BUCKETS,
            registry=r,
        )
        self.round_seconds = Histogram(
            "epochal_control_round_seconds",
            "Seconds from an epoch's first loss report to its decision (the wait for the "
            "slowest rank and the coordinator's own work).",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.restarts = Counter(
            "epochal_restarts", "Times the run was restarted after a failure.", registry=r
        )
        self.refused = Counter(
            "epochal_refused", "Workers refused (wrong job or token, surplus).", registry=r
        )
        self.aborted = gauge("epochal_aborted", "1 once the run was aborted, else 0.")
        self._refused_seen = 0
        try:
            self._server = MetricsServer(
                self.host, port, lambda: (generate_latest(r), CONTENT_TYPE_LATEST)
            )
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics at {self.host}:{port} (--metrics-address): {exc}"
            ) from None
        self.port: int = self._server.port
        self._closed = threading.Event()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def on_start(self, start: RunStart) -> None:
        if start.attempt > 0:
            self.restarts.inc()
        self.aborted.set(0)
        self.world_size.set(start.world_size)
        self.joined.set(0)
        self.epoch.set(start.start_epoch)
        self._refused_seen = 0  # a new coordinator counts its refusals from 0

    def on_join(self, world: World) -> None:
        self.joined.set(world.joined)
        self.world_size.set(world.world_size)

    def _take(self, snapshot: StatusSnapshot) -> None:
        self.epoch.set(snapshot.epoch)
        self.world_size.set(snapshot.world_size)
        self.joined.set(snapshot.joined)
        if snapshot.best_epoch is not None:
            self.best_epoch.set(snapshot.best_epoch)
        if snapshot.refused > self._refused_seen:
            self.refused.inc(snapshot.refused - self._refused_seen)
            self._refused_seen = snapshot.refused

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        self._take(status)
        if record.get("kind") != "epoch":
            return
        for gauge, name in (
            (self.train_loss, "train_loss"),
            (self.valid_loss, "valid_loss"),
            (self.smoothed_loss, "smoothed_loss"),
            (self.best_epoch, "best_epoch"),
        ):
            value = record.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                gauge.set(value)
        seconds = record.get("seconds")
        if isinstance(seconds, int | float):
            self.epoch_seconds.observe(seconds)
        if status.round_seconds is not None:
            self.round_seconds.observe(status.round_seconds)

    def on_status(self, snapshot: StatusSnapshot) -> None:
        self._take(snapshot)

    def on_end(self, result: Mapping[str, Any]) -> None:
        self.aborted.set(1 if result.get("status") == "aborted" else 0)

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._server.close()
