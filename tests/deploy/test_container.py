"""deploy/container built and run for real, by a private dockerd, offline.

The image is built from this checkout exactly as the deploy README says (repository root as the
context), with the base image and the offline switch given as build arguments: the base is a
debootstrapped Debian (no registry is reachable), and every wheel comes from the local disk. The
container then trains the digits example with ``epochal run --nproc 2`` to completion, as its
non-root user; and the compose file's services (keys, coordinator, two workers) run as the
containers the file declares and train it with CURVE on. Minutes on a first run (debootstrap,
wheels); the cached parts make reruns faster.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.docker_daemon import (
    Docker,
    base_rootfs,
    missing_programs,
    private_dockerd,
    wheelhouse,
)
from tests.integration.conftest import MARK, marked_pids

REPO = Path(__file__).resolve().parents[2]
CONTAINER = REPO / "deploy" / "container"
BASE_TAG = "epochal-test-base:bookworm"
IMAGE_TAG = "epochal-test:cpu"

pytestmark = [
    pytest.mark.container,
    pytest.mark.slow,  # trains the digits example on two workers
    # both tests in one test process: one daemon and one image (module-scoped) serve them
    pytest.mark.xdist_group("dockerd"),
    pytest.mark.timeout(2400),
    pytest.mark.skipif(os.geteuid() != 0, reason="a private dockerd needs root"),
    pytest.mark.skipif(
        bool(missing_programs()),
        reason=f"missing {', '.join(missing_programs())}: apt-get install docker.io debootstrap",
    ),
]


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark}
    try:
        with private_dockerd(env) as running:
            yield running
    finally:
        leftovers = marked_pids(mark)
        for pid in leftovers:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        assert not leftovers, f"processes outlived dockerd: {leftovers}"


def build_context(tmp: Path) -> Path:
    """The files the Dockerfile copies, plus the wheels for an offline build."""
    context = tmp / "context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, context / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("epochal", "examples"):
        shutil.copytree(REPO / name, context / name, ignore=ignore)
    shutil.copytree(REPO / "deploy" / "container", context / "deploy" / "container", ignore=ignore)
    wheels = context / "deploy" / "container" / "wheels"
    for wheel in wheelhouse(REPO).glob("*.whl"):
        os.link(wheel, wheels / wheel.name)  # same file system: no copy of torch's 200 MB
    return context


@pytest.fixture(scope="module")
def image(docker: Docker, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image, built offline from this checkout on the debootstrapped base; timed."""
    started = time.monotonic()
    rootfs = base_rootfs()
    context = build_context(tmp_path_factory.mktemp("image"))
    TIMINGS["base and wheels (cached after the first run)"] = time.monotonic() - started

    mark = time.monotonic()
    docker("import", str(rootfs), BASE_TAG)
    TIMINGS["docker import"] = time.monotonic() - mark

    mark = time.monotonic()
    build = docker(
        "build",
        "--network",
        "host",
        "--file",
        str(context / "deploy" / "container" / "Dockerfile"),
        "--build-arg",
        f"BASE_IMAGE={BASE_TAG}",
        "--build-arg",
        "OFFLINE=1",
        "--tag",
        IMAGE_TAG,
        str(context),
        timeout=1800,
    )
    TIMINGS["docker build"] = time.monotonic() - mark
    assert "Successfully tagged" in build.stdout, build.stdout[-3000:]
    return IMAGE_TAG


TIMINGS: dict[str, float] = {}


def report(extra: str) -> None:
    print("container timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()) + extra)


def test_image_trains_digits_on_two_workers_as_a_non_root_user(docker: Docker, image: str) -> None:
    # the image runs as its numeric non-root user, with epochal as the entrypoint
    config = docker(
        "image", "inspect", "--format", "{{.Config.User}} {{json .Config.Entrypoint}}", image
    ).stdout.split(maxsplit=1)
    assert config[0] == "10001:10001" and config[1].strip() == '["epochal"]', config

    mark = time.monotonic()
    run = docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--shm-size",
        "256m",
        "--env",
        "OMP_NUM_THREADS=1",
        image,
        "run",
        "--nproc",
        "2",
        "--epochs",
        "5",
        "examples/digits.py",
        timeout=600,
        check=False,
    )
    TIMINGS["docker run (5 epochs)"] = time.monotonic() - mark
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"epoch 4 \[5/5\]", out), out
    assert re.search(r"best epoch \d of 5: .* test accuracy 0\.\d+", out), out
    report("")


def service_run_args(name: str, service: dict[str, Any], project: str) -> list[str]:
    """``docker run`` arguments for one compose service: its entrypoint, command, environment,
    named volumes and shm size as the compose file declares them."""
    args = ["--name", f"{project}-{name}", "--shm-size", str(service.get("shm_size", "64m"))]
    for volume in service.get("volumes", []):
        source, target = volume.split(":", 1)
        args += ["--volume", f"{project}-{source}:{target}"]
    for key, value in service.get("environment", {}).items():
        args += ["--env", f"{key}={value}"]
    entrypoint = list(service.get("entrypoint", []))
    if entrypoint:
        args += ["--entrypoint", entrypoint[0]]
    return [*args, service["image"], *entrypoint[1:], *service.get("command", [])]


def test_compose_services_train_digits_with_curve_keys(docker: Docker, image: str) -> None:
    """The compose file's services, run as containers of the same network namespace.

    This daemon has no bridge network, so instead of ``docker compose up`` each service becomes a
    ``docker run`` with what the file declares; the workers join the coordinator's network
    namespace, where the service name ``coordinator`` is mapped to its address.
    """
    compose = yaml.safe_load((CONTAINER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"keys", "coordinator", "worker-0", "worker-1"}
    for service in services.values():
        service["image"] = image  # the tag the file names, built here under a test tag
    project = f"epochal-test-{uuid.uuid4().hex[:8]}"
    mark = time.monotonic()

    keys = docker(
        "run",
        "--rm",
        "--network",
        "none",
        *service_run_args("keys", services["keys"], project),
        check=False,
    )
    assert keys.returncode == 0, keys.stdout + keys.stderr
    coordinator = f"{project}-coordinator"
    docker(
        "run",
        "--detach",
        "--network",
        "none",
        "--add-host",
        "coordinator:127.0.0.1",
        *service_run_args("coordinator", services["coordinator"], project),
    )
    for worker in ("worker-0", "worker-1"):
        docker(
            "run",
            "--detach",
            "--network",
            f"container:{coordinator}",
            *service_run_args(worker, services[worker], project),
        )
    codes = {}
    for name in ("coordinator", "worker-0", "worker-1"):
        waited = docker("wait", f"{project}-{name}", timeout=600, check=False)
        codes[name] = waited.stdout.strip()
    logs = {}
    for name in codes:
        shown = docker("logs", f"{project}-{name}", check=False)
        logs[name] = shown.stdout + shown.stderr
    TIMINGS["compose services (15 epochs)"] = time.monotonic() - mark
    assert codes == {"coordinator": "0", "worker-0": "0", "worker-1": "0"}, logs
    assert "finished after 15 epochs" in logs["coordinator"], logs["coordinator"]
    assert re.search(r"best epoch \d+ of 15: .* test accuracy", logs["worker-0"] + logs["worker-1"])
    # the coordinator bound 0.0.0.0, which it refuses without CURVE keys, and the workers were
    # admitted: the keys the keys service wrote into the shared volume work as the file wires them
    report("")
