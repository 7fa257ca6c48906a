"""A script written for torchrun (``init_process_group()`` from the environment, DDP, its own loop,
nothing of epochal) run unchanged on two hosts through ``epochal worker --torchrun``: a coordinator
on a third host, CURVE on, no network hints. The supervisor joins the run for the script and gives
it torchrun's variables; the weights equal torchrun's own run of the script bit for bit, and a
rank whose script fails stops the other within the configured bound."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from epochal.worker.plain import FEATURES
from tests.multihost.test_across_hosts import (
    ABORT_GRACE,
    HEARTBEAT_INTERVAL,
    MARGIN,
    Cluster,
    clean_env,
)

SCRIPT = Path(__file__).resolve().parents[1] / "integration" / "scripts" / "torchrun_ddp.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def members(cluster: Cluster, *script_args: str) -> list[subprocess.Popen[bytes]]:
    """``epochal worker --torchrun`` on each worker host, running the script with its args."""
    argv = ["python", "-m", "epochal", "worker", "--connect", cluster.endpoint, "--torchrun"]
    argv += ["--", "python", str(SCRIPT), *script_args]
    return [cluster.worker(i, argv) for i in range(cluster.workers)]


def test_a_torchrun_script_trains_across_hosts_as_under_torchrun(make_hosts, tmp_path):
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    run_dir = tmp_path / "run"
    coordinator = cluster.coordinator("--run-dir", str(run_dir))
    workers = members(cluster, "--out", str(tmp_path / "across.pt"))
    outputs = [cluster.wait(w) for w in workers]
    log = cluster.wait(coordinator)
    assert coordinator.returncode == 0, cluster.dump()
    assert all(w.returncode == 0 for w in workers), cluster.dump()
    assert "finished: its workers ran their own loop, no epochs here" in log, log
    # the data plane is on each host's own network, never on the loopback its hostname maps to
    for rank in (0, 1):
        assert f"data plane at {net[rank + 1].address}" in log, log
    joined = [re.search(r"rank (\d) of 2, local rank 0", out) for out in outputs]
    assert sorted(int(m.group(1)) for m in joined if m) == [0, 1], outputs
    assert sum(FEATURES in out for out in outputs) == 1, outputs  # said once, by rank 0

    # torchrun itself, the same script on one machine: the same weights, bit for bit
    reference = tmp_path / "torchrun.pt"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", str(SCRIPT), "--out", str(reference)],
        env=clean_env(),
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ours, theirs = torch.load(tmp_path / "across.pt"), torch.load(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    cluster.none_left()


def test_a_failing_script_on_one_host_stops_the_other(make_hosts, tmp_path):
    net = make_hosts(3)
    cluster = Cluster(net, tmp_path)
    coordinator = cluster.coordinator("--run-dir", str(tmp_path / "run"))
    # rank 1's script exits 3 once its group is made; rank 0's sleeps 600 s outside any
    # collective, so only epochal can stop it
    workers = members(cluster, "--out", str(tmp_path / "out.pt"), "--fail-rank", "1")
    log_file = coordinator.log  # type: ignore[attr-defined]
    while "failed: its torchrun script exited with status 3" not in log_file.read_text():
        assert coordinator.poll() is None, cluster.dump()
        time.sleep(0.05)
    failed = time.monotonic()
    log = cluster.wait(coordinator, deadline=60)
    assert coordinator.returncode == 1, log
    # the other rank's script gets SIGTERM when the abort arrives, SIGKILL abort_grace later
    bound = ABORT_GRACE + HEARTBEAT_INTERVAL + MARGIN
    outputs = [cluster.wait(w, deadline=bound + 30) for w in workers]
    took = time.monotonic() - failed
    assert took < bound, (took, cluster.dump())
    assert all(w.returncode != 0 for w in workers), cluster.dump()
    assert any("RunAborted" in out and "rank 1" in out for out in outputs), outputs
    assert not (tmp_path / "out.pt").exists()
    cluster.none_left()
