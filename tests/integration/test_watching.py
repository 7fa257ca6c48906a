"""Watching a real run: status.json, curve.png, TensorBoard events and live Prometheus metrics.

``epochal run`` trains the digits example with every observer on, monitoring its validation
accuracy; the metrics are scraped while the run goes, the files are read once it has ended, and
``epochal status`` summarises it. Every observer shows the same epoch and calls the monitored
value by its name.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epochal.observe.statusfile import describe
from tests.integration.conftest import REPO, Spawner

pytestmark = pytest.mark.slow

RENDEZVOUS_TIMEOUT = 120.0
DEADLINE = 300.0
HOLD_MS = 15_000
"""How long epoch 1's first step waits: the window in which the live run is looked at."""
"""Three epochs of a small classifier; only a hang should reach this."""

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> dict[str, float] | None:
    """The samples at ``url`` by name, or None while nothing answers there."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = sample.value
    return samples


def test_a_watched_run_leaves_status_curve_events_and_serves_metrics(
    spawn: Spawner, tmp_path: Path
):
    port = free_port()
    run_dir = tmp_path / "run"
    board = tmp_path / "tb"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--run-dir",
        str(run_dir),
        "--rendezvous-timeout",
        f"{RENDEZVOUS_TIMEOUT:g}",
        "--tensorboard",
        str(board),
        "--metrics-address",
        f"127.0.0.1:{port}",
        "--monitor",
        "accuracy",
        "--monitor-mode",
        "max",
        str(REPO / "examples" / "digits.py"),
        # epoch 1 holds its first step, so the run is still going when it is looked at
        EPOCHAL_FAULT=f"delay@train-step:epoch=1:step=0:ms={HOLD_MS}",
    )
    # the server is up before the run starts and stays up until the run's last attempt is over;
    # scrape until an epoch has been decided (the run's own timeouts bound the wait)
    url = f"http://127.0.0.1:{port}/metrics"
    live: dict[str, float] | None = None
    seen = ""
    deadline = time.monotonic() + DEADLINE
    while proc.poll() is None and time.monotonic() < deadline:
        samples = scrape(url)
        if samples is not None and samples.get("epochal_workers_joined", 0) < 2:
            assert "epochal_epoch" not in samples, samples  # no epoch runs yet: no value
        if samples is not None and samples.get("epochal_epoch_seconds_count", 0) >= 1:
            live = samples
            seen = describe(run_dir)  # `epochal status` of the live run, epoch 1 being held
            break
        time.sleep(0.1)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    assert live is not None, f"no metrics with a decided epoch at {url} during the run:\n{output}"
    assert live["epochal_world_size"] == 2 and live["epochal_workers_joined"] == 2
    assert live["epochal_train_loss"] > 0 and live["epochal_aborted"] == 0
    assert live["epochal_restarts_total"] == 0
    assert live["epochal_epoch"] == 1  # epoch 0 decided, epoch 1 held in its first step
    assert 0 < live["epochal_valid_accuracy"] <= 1
    assert live["epochal_smoothed_accuracy"] == live["epochal_valid_accuracy"]  # smoothing 1
    assert "epochal_smoothed_loss" not in live
    assert scrape(url) is None, "the metrics server outlived the run"
    header = seen.splitlines()[0]
    assert re.search(r": running, epoch 1 \[2/3\], 2/2 workers joined$", header), seen
    assert "last epoch 0: " in seen and re.search(r"^rank\s+host\s+phase", seen, re.M), seen
    assert "smoothed accuracy" in seen and "smoothed loss" not in seen, seen
    rows = [line.split() for line in seen.splitlines() if re.match(r"^\d+\s", line)]
    assert len(rows) == 2 and all(row[3] == "1" for row in rows), seen  # the header's epoch

    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished", status
    assert status["epoch"] == 2 and status["epochs"] == 3

    curve = (run_dir / "curve.png").read_bytes()
    assert curve.startswith(PNG_SIGNATURE) and len(curve) > 1000

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(board / run_dir.name))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/train", "loss/valid", "time/epoch_seconds"} <= tags, tags
    assert {"metrics/valid_accuracy", "metrics/smoothed_accuracy"} <= tags, tags
    assert "loss/smoothed" not in tags and "loss/best" not in tags, tags
    assert [e.step for e in acc.Scalars("loss/train")] == [0, 1, 2]

    summary = subprocess.run(
        [sys.executable, "-m", "epochal", "status", str(run_dir)],
        env=spawn.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert summary.returncode == 0, summary.stderr
    assert re.search(
        r"finished after 3 epochs, best epoch \d \(smoothed accuracy 0\.\d{4}\)", summary.stdout
    ), summary.stdout
