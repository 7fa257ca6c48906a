"""``--metrics-address HOST:PORT``: the run's metrics at ``http://HOST:PORT/metrics``.

The metrics live in a prometheus-client registry of its own (not the process-wide default, so
nothing else a process registers leaks in, and two coordinators in one process do not collide)
and are rendered by its ``generate_latest``; they are served on loopback unless a host is given,
by :class:`~epochal.observe.metricsserver.MetricsServer` rather than prometheus-client's own
``start_http_server``, which starts a thread per connection with no limit and no timeout and
answers every path (see that module for the bounds). No metric has per-rank labels: a run of
1,000 ranks is as many series as a run of two.

A value the run does not have yet is absent from a scrape, not 0 and not NaN: that is how
Prometheus says "no value" (NaN is a number to it, and 0 is a real epoch). ``epochal_epoch``
appears once an epoch of the attempt runs; the losses, the best epoch and each metric once an
epoch has reported them. The gauges of the last epoch are :class:`Latest`, a collector that
yields only the values it holds, under names that follow the run: every metric the journal
records (``epochal_valid_accuracy``) and the smoothed monitored value (``epochal_smoothed_loss``,
or ``epochal_smoothed_accuracy`` with ``--monitor accuracy``).
"""

from __future__ import annotations

import ipaddress
import math
import re
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from epochal.cli.argtypes import parse_address
from epochal.errors import ConfigError
from epochal.observe.metricsserver import MetricsServer
from epochal.observe.observer import RunObserver, RunStart, StatusSnapshot, World
from epochal.rundir.paths import DEFAULT_MONITOR, monitor_of

if TYPE_CHECKING:
    from prometheus_client.core import Metric

EXTRA_HINT = "pip install 'epochal[metrics]'"

EPOCH_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, math.inf)
ROUND_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, math.inf)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


RUNNING_STATES = frozenset({"running", "finishing", "ended"})
"""The coordinator's states in which an epoch of the attempt runs (or ran): ``epochal_epoch``
is set from then on."""

MAX_METRICS = 128
"""Most metric gauges exported (the first by name): the workers report at most 64 per split."""

_METRIC_KEY = re.compile(r"^(train|valid)_[A-Za-z][A-Za-z0-9_]{0,63}$")
"""A journal key of a metric (``valid_accuracy``), which becomes ``epochal_valid_accuracy``."""


class Latest:
    """A prometheus-client collector of gauges that hold a value or are absent: ``set`` one by
    name with its help text, ``forget`` it again. Called from the coordinator's thread, scraped
    from the metrics server's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, tuple[str, float]] = {}

    def set(self, name: str, documentation: str, value: float) -> None:
        with self._lock:
            self._values[name] = (documentation, float(value))

    def forget(self, name: str) -> None:
        with self._lock:
            self._values.pop(name, None)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            values = sorted(self._values.items())
        for name, (documentation, value) in values:
            yield GaugeMetricFamily(name, documentation, value=value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class Prometheus(RunObserver):
    """Serves the metrics from construction until :meth:`close`; ``port`` is the bound port."""

    def __init__(self, address: str) -> None:
        try:
            from prometheus_client import (
                CONTENT_TYPE_LATEST,
                CollectorRegistry,
                Counter,
                Gauge,
                Histogram,
                generate_latest,
            )
        except ImportError:
            raise ConfigError(
                f"--metrics-address needs the prometheus-client package: {EXTRA_HINT}"
            ) from None

        self.host, port = parse_address(address)
        self.registry = CollectorRegistry()
        r = self.registry
        self.world_size = Gauge(
            "epochal_world_size",
            "Workers in the run's world now (fewer after a lost rank in an elastic run).",
            registry=r,
        )
        self.joined = Gauge("epochal_workers_joined", "Workers that have joined.", registry=r)
        self.latest = Latest()
        r.register(self.latest)
        self.monitor = DEFAULT_MONITOR
        self._metrics: set[str] = set()
        # the journal keys of the metrics exported (at most MAX_METRICS)
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
        self.aborted = Gauge("epochal_aborted", "1 once the run was aborted, else 0.", registry=r)
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
        monitor = monitor_of(start.config)
        if monitor != self.monitor:
            self.latest.forget(f"epochal_smoothed_{self.monitor}")
            self.monitor = monitor
        self.latest.forget("epochal_epoch")  # no epoch of this attempt runs yet
        self._refused_seen = 0  # a new coordinator counts its refusals from 0

    def on_join(self, world: World) -> None:
        self.joined.set(world.joined)
        self.world_size.set(world.world_size)

    def _take(self, snapshot: StatusSnapshot) -> None:
        if snapshot.state in RUNNING_STATES:
            self.latest.set(
                "epochal_epoch",
                "The epoch being run (or the last one run), numbered from 0; absent until an "
                "epoch of this attempt runs.",
                snapshot.epoch,
            )
        self.world_size.set(snapshot.world_size)
        self.joined.set(snapshot.joined)
        if snapshot.best_epoch is not None:
            self.latest.set("epochal_best_epoch", _BEST_EPOCH, snapshot.best_epoch)
        if snapshot.refused > self._refused_seen:
            self.refused.inc(snapshot.refused - self._refused_seen)
            self._refused_seen = snapshot.refused

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        self._take(status)
        if record.get("kind") != "epoch":
            return
        monitor = self.monitor
        smoothed = (
            f"The smoothed monitored value (--monitor {monitor}) after the last epoch that had one."
        )
        for name, key, documentation in (
            ("epochal_train_loss", "train_loss", "Last epoch's train loss."),
            ("epochal_valid_loss", "valid_loss", "Last validated epoch's validation loss."),
            (f"epochal_smoothed_{monitor}", "smoothed_loss", smoothed),
            ("epochal_best_epoch", "best_epoch", _BEST_EPOCH),
            ("epochal_data_pass", "data_pass", "The pass over the data the last epoch ended in."),
            ("epochal_data_offset", "data_offset", "Samples of that pass consumed by then."),
        ):
            value = _number(record.get(key))
            if value is not None:
                self.latest.set(name, documentation, value)
        keys = record.get("metrics")
        for key in sorted(keys)[:MAX_METRICS] if isinstance(keys, list) else ():
            value = _number(record.get(key)) if isinstance(key, str) else None
            if value is None or not _METRIC_KEY.match(key):
                continue
            if key not in self._metrics and len(self._metrics) >= MAX_METRICS:
                continue
            self._metrics.add(key)
            self.latest.set(
                f"epochal_{key}", f"Metric {key} of the last epoch that reported it.", value
            )
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


_BEST_EPOCH = "The best epoch so far."
