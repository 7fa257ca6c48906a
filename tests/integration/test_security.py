"""A real job under CURVE and a job token; strangers refused with a clear error at the worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import Spawner

pytestmark = pytest.mark.slow

DEADLINE = 90.0
PREFIX = "epochal coordinator listening on "


def generate(spawn: Spawner, where: Path, *names: str) -> Path:
    args = [a for n in names for a in ("--name", n)]
    code, output = spawn.finish(spawn.epochal("keys", "generate", str(where), *args), 30)
    assert code == 0, output
    return where


def coordinator(spawn: Spawner, tmp_path: Path, *extra: str, **env: str):
    proc = spawn.epochal(
        "coordinator",
        "--world-size",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        *extra,
        **env,
    )
    line = proc.stdout.readline()
    assert line.startswith(PREFIX), line
    return proc, line[len(PREFIX) :].strip()


def test_a_job_completes_under_curve_and_an_unknown_key_is_refused(spawn, tmp_path):
    keys = generate(spawn, tmp_path / "keys", "alice", "bob")
    strangers = generate(spawn, tmp_path / "other", "mallory")
    proc, endpoint = coordinator(
        spawn,
        tmp_path,
        "--curve-key",
        str(keys / "coordinator.key_secret"),
        "--curve-allowed",
        str(keys / "allowed"),
    )
    # a worker whose key is not on the list never reaches the coordinator, and says why
    mallory = spawn.script(
        "linear.py",
        EPOCHAL_COORDINATOR=endpoint,
        EPOCHAL_CURVE_KEY=str(strangers / "workers" / "mallory.key_secret"),
        EPOCHAL_CURVE_SERVER_KEY=str(keys / "coordinator.key"),
    )
    code, output = spawn.finish(mallory, DEADLINE)
    assert code == 1
    assert "the coordinator refused this worker's CURVE key" in output
    # nor does one without CURVE at all
    plain = spawn.script("linear.py", EPOCHAL_COORDINATOR=endpoint)
    code, output = spawn.finish(plain, DEADLINE)
    assert code == 1
    assert "the coordinator requires CURVE and this worker has no keys" in output

    workers = [
        spawn.script(
            "linear.py",
            EPOCHAL_COORDINATOR=endpoint,
            EPOCHAL_CURVE_KEY=str(keys / "workers" / f"{name}.key_secret"),
            EPOCHAL_CURVE_SERVER_KEY=str(keys / "coordinator.key"),
        )
        for name in ("alice", "bob")
    ]
    for worker in workers:
        code, output = spawn.finish(worker, DEADLINE)
        assert code == 0, output
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert "finished after 2 epochs" in output
    spawn.assert_none_left()


def test_a_wrong_or_missing_token_is_refused_at_the_worker(spawn, tmp_path):
    proc, endpoint = coordinator(spawn, tmp_path, EPOCHAL_TOKEN="s3cret")
    for token in ("guess", ""):
        worker = spawn.script("linear.py", EPOCHAL_COORDINATOR=endpoint, EPOCHAL_TOKEN=token)
        code, output = spawn.finish(worker, DEADLINE)
        assert code == 1
        assert "JoinRefused" in output and "wrong or missing job token" in output
    assert proc.poll() is None  # strangers do not end the run
    proc.terminate()
    spawn.finish(proc, 30)


def test_binding_beyond_loopback_needs_keys_or_insecure(spawn, tmp_path):
    proc = spawn.epochal("coordinator", "--world-size", "1", "--bind", "tcp://0.0.0.0:0")
    code, output = spawn.finish(proc, 30)
    assert code == 2
    assert "has no CURVE keys" in output and "--insecure" in output
    proc = spawn.epochal(
        "coordinator",
        "--world-size",
        "1",
        "--bind",
        "tcp://0.0.0.0:0",
        "--insecure",
        "--rendezvous-timeout",
        "0.5",
        "--run-dir",
        str(tmp_path / "r"),
    )
    code, output = spawn.finish(proc, 30)
    assert code == 1  # nobody came
    assert "served without CURVE (--insecure)" in output
    proc = spawn.epochal(
        "coordinator",
        "--world-size",
        "1",
        "--curve-key",
        "/no/such.key_secret",
        "--curve-allowed",
        str(tmp_path),
    )
    code, output = spawn.finish(proc, 30)
    assert code == 2 and "/no/such.key_secret" in output
