"""The address file across hosts: a coordinator on port 0 of 0.0.0.0, workers elsewhere read it.

As in a batch job on a shared file system: nobody knows the port in advance, every host's name
resolves to loopback and no host has a default route, so the address written must be found from
the interfaces, and never be 0.0.0.0 or loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost import netns

REPO = Path(__file__).resolve().parents[2]
LINEAR = REPO / "tests" / "integration" / "scripts" / "linear.py"
RUN_DEADLINE = 300.0  # a short training run on a loaded machine: a hang, not a bound


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any epochal, gloo or NCCL setting: no hints."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("EPOCHAL_", "GLOO_", "NCCL_", "MASTER_"))
    }
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "EPOCHAL_PROGRESS": "0"})
    return {**env, **extra}


pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(RUN_DEADLINE) + 60)]


def test_workers_on_other_hosts_find_a_port_0_coordinator_through_the_address_file(
    make_hosts, tmp_path: Path
) -> None:
    net: netns.Network = make_hosts(3)
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "epochal", "keys", "generate", "--workers", "2", str(keys)],
        check=True,
        capture_output=True,
        env=clean_env(),
    )
    shared = tmp_path / "shared" / "coordinator.addr"
    shared.parent.mkdir()
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "worker0", "worker1")}
    procs = {}
    for i in range(2):  # workers first: they wait for the file
        with logs[f"worker{i}"].open("wb") as sink:
            procs[f"worker{i}"] = net[1 + i].popen(
                ["python", str(LINEAR)],
                env=clean_env(
                    EPOCHAL_COORDINATOR=f"file:{shared}",
                    EPOCHAL_CURVE_KEY=str(keys / "workers" / f"worker-{i}.key_secret"),
                    EPOCHAL_CURVE_SERVER_KEY=str(keys / "coordinator.key"),
                ),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
    for i in range(2):  # each says it waits (or exits, failing below) before the file exists
        end = time.monotonic() + RUN_DEADLINE
        while "for the coordinator's address in" not in logs[f"worker{i}"].read_text():
            assert procs[f"worker{i}"].poll() is None, logs[f"worker{i}"].read_text()
            assert time.monotonic() < end, logs[f"worker{i}"].read_text()
            time.sleep(0.1)
    argv = ["python", "-m", "epochal", "coordinator", "--bind", "tcp://0.0.0.0:0"]
    argv += ["--address-file", str(shared), "--world-size", "2", "--epochs", "2"]
    argv += ["--curve-key", str(keys / "coordinator.key_secret")]
    argv += ["--curve-allowed", str(keys / "allowed"), "--run-dir", str(tmp_path / "run")]
    with logs["coordinator"].open("wb") as sink:
        procs["coordinator"] = net[0].popen(
            argv, env=clean_env(), stdout=sink, stderr=subprocess.STDOUT
        )

    def dump() -> str:
        return "\n".join(f"--- {n}\n{p.read_text()}" for n, p in logs.items() if p.exists())

    for name, proc in procs.items():
        try:
            proc.wait(timeout=RUN_DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} ran past {RUN_DEADLINE} s\n{dump()}")
        assert proc.returncode == 0, dump()
    written = logs["coordinator"].read_text()
    assert f"address tcp://{net[0].address}:" in written and "written to" in written, dump()
    assert not shared.exists()
    net.close()
    assert not net.leftover()
