"""deploy/container/Dockerfile built and run for real, by a private dockerd, offline.

The image is built from this checkout exactly as the deploy README says (repository root as the
context), with the base image and the offline switch given as build arguments: the base is a
debootstrapped Debian (no registry is reachable), and every wheel comes from the local disk. The
container then trains the digits example with ``epochal run --nproc 2`` to completion, as its
non-root user. Minutes on a first run (debootstrap, wheels); the cached parts make reruns faster.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.docker_daemon import (
    Docker,
    base_rootfs,
    missing_programs,
    private_dockerd,
    wheelhouse,
)
from tests.integration.conftest import MARK, marked_pids

REPO = Path(__file__).resolve().parents[2]
BASE_TAG = "epochal-test-base:bookworm"
IMAGE_TAG = "epochal-test:cpu"

pytestmark = [
    pytest.mark.container,
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


def test_image_builds_offline_and_trains_digits_on_two_workers(
    docker: Docker, tmp_path: Path
) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    rootfs = base_rootfs()
    context = build_context(tmp_path)
    timings["base and wheels (cached after the first run)"] = time.monotonic() - started

    mark = time.monotonic()
    docker("import", str(rootfs), BASE_TAG)
    timings["docker import"] = time.monotonic() - mark

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
    timings["docker build"] = time.monotonic() - mark
    assert "Successfully tagged" in build.stdout, build.stdout[-3000:]

    # the image runs as its numeric non-root user, with epochal as the entrypoint
    config = docker(
        "image", "inspect", "--format", "{{.Config.User}} {{json .Config.Entrypoint}}", IMAGE_TAG
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
        IMAGE_TAG,
        "run",
        "--nproc",
        "2",
        "--epochs",
        "5",
        "examples/digits.py",
        timeout=600,
        check=False,
    )
    timings["docker run (5 epochs)"] = time.monotonic() - mark
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"epoch 4 \[5/5\]", out), out
    assert re.search(r"best epoch \d of 5: .* test accuracy 0\.\d+", out), out
    print(
        "container timings: "
        + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in timings.items())
        + f", total {time.monotonic() - started:.1f} s"
    )
