"""A private Docker daemon and an offline base image, for building deploy/container for real.

No image registry is reachable from the test machines, so the base image is a Debian root file
system made with ``debootstrap`` (from the Debian mirror apt is configured with) and turned into an
image with ``docker import``; the root file system is cached as a tarball under
:data:`CACHE_DIR`, so only the first run pays for it. The daemon is Debian's ``dockerd`` with its
data, runtime state, pid file and socket under one temporary directory, no bridge and no iptables
rules: it touches nothing of the host's networking, and is stopped by its pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path(os.environ.get("EPOCHAL_TEST_CACHE", "/var/cache/epochal-test"))
"""Where the debootstrapped root file system and the downloaded wheels are kept between runs."""

SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv")
"""Beyond Debian's minimal set: the Python the image's virtual environment is made from."""

LOCAL_WHEELS = Path("/opt/wheels")
"""Where this machine keeps the torch wheel; it goes into the build context, never downloaded."""

START_TIMEOUT = 60.0
"""Seconds for dockerd to answer on its socket."""

DATA_TMPFS_SIZE = "8g"
"""Upper bound of the daemon's in-memory data root (the build uses about 2-3 GB of it)."""

PROGRAMS = ("dockerd", "debootstrap")


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None]


def docker_client() -> str:
    """Debian's client, matched to its daemon, when installed; else the first ``docker``."""
    found = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
    if found is None:
        raise RuntimeError("no docker client: apt-get install docker.io")
    return found


def debian_mirror() -> str:
    """The Debian mirror apt uses here (deb822 ``URIs:`` or a one-line ``deb`` entry)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^URIs:\s*(\S+)", text, re.M) + re.findall(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+" + SUITE + r"\s", text, re.M
        ):
            if uri.rstrip("/").endswith("/debian"):
                return uri
    return "http://deb.debian.org/debian"


def base_rootfs() -> Path:
    """A tarball of a minimal Debian with Python, made once with debootstrap and cached."""
    tarball = CACHE_DIR / f"debian-{SUITE}-{'-'.join(BASE_PACKAGES)}.tar"
    if tarball.exists():
        return tarball
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix="rootfs-") as tmp:
        root = Path(tmp) / "root"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                SUITE,
                str(root),
                debian_mirror(),
            ],
            check=True,
            capture_output=True,
            timeout=1200,
        )
        shutil.rmtree(root / "var" / "lib" / "apt" / "lists", ignore_errors=True)
        shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        partial = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."],
            check=True,
            timeout=600,
        )
        os.replace(partial, tarball)  # whole or absent, for the next run
    return tarball


def wheelhouse(repo: Path, python_version: str = "3.11") -> Path:
    """Every wheel the image installs (torch from :data:`LOCAL_WHEELS`), fetched once, cached.

    The requirement list is read from ``pyproject.toml`` (dependencies, the ``examples`` extra,
    the build backend), so the image can be built with ``OFFLINE=1``. The wheels are picked for
    this machine's Python, which must be the image's (``python_version``, Debian's in the base).
    """
    project = tomllib.loads((repo / "pyproject.toml").read_text())
    torch_wheels = sorted(LOCAL_WHEELS.glob(f"torch-*-cp{python_version.replace('.', '')}-*.whl"))
    if not torch_wheels:
        raise RuntimeError(f"no torch wheel for Python {python_version} in {LOCAL_WHEELS}")
    torch = torch_wheels[-1]
    wanted = [
        str(torch),
        *(r for r in project["project"]["dependencies"] if not r.startswith("torch")),
        *project["project"]["optional-dependencies"]["examples"],
        *project["build-system"]["requires"],
    ]
    house = CACHE_DIR / "wheels"
    stamp = house / ".requirements"
    if stamp.exists() and stamp.read_text() == "\n".join(wanted):
        return house
    house.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "python3",
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "--dest",
            str(house),
            *wanted,
        ],
        check=True,
        capture_output=True,
        timeout=1200,
    )
    stamp.write_text("\n".join(wanted))
    return house


@dataclass
class Docker:
    """A running private daemon and a client bound to it."""

    root: Path
    socket: Path
    client: str

    def __call__(
        self, *args: str, timeout: float = 600.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.client, "-H", f"unix://{self.socket}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": str(self.root / "cli")},
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"docker {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            )
        return done


@contextmanager
def private_dockerd(env: dict[str, str]) -> Iterator[Docker]:
    """Start dockerd with everything under a new short temporary directory; stop it by pid.

    The directory is short on purpose: containerd's sockets live under ``--exec-root`` and a unix
    socket path must stay under 108 bytes.
    """
    root = Path(tempfile.mkdtemp(prefix="epd-", dir="/tmp"))
    sock = root / "docker.sock"
    # image layers in memory: a build writes ~2 GB of small files, which a disk shared with other
    # jobs takes minutes to delete again; a tmpfs goes with one umount
    (root / "data").mkdir()
    subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={DATA_TMPFS_SIZE},mode=0700",
            "tmpfs",
            str(root / "data"),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    log = (root / "dockerd.log").open("wb")
    proc = subprocess.Popen(
        [
            "dockerd",
            f"--data-root={root}/data",
            f"--exec-root={root}/x",
            f"--pidfile={root}/docker.pid",
            f"--host=unix://{sock}",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    docker = Docker(root=root, socket=sock, client=docker_client())
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while docker("version", check=False, timeout=30).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"dockerd did not come up (status {proc.poll()}):\n"
                    + (root / "dockerd.log").read_text(errors="replace")[-4000:]
                )
            time.sleep(0.5)
        yield docker
    finally:
        if proc.poll() is None:
            remaining = docker("ps", "-aq", check=False, timeout=60).stdout.split()
            if remaining:
                docker("rm", "-f", *remaining, check=False, timeout=120)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        log.close()
        # overlay and shm mounts normally go with the daemon; never delete through one left over
        for mountpoint in _mounts_under(root):
            subprocess.run(["umount", "-l", mountpoint], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def _mounts_under(root: Path) -> list[str]:
    """Mount points below ``root``, deepest first."""
    prefix = f"{root}/"
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point.startswith(prefix):
            points.append(point)
    return sorted(points, key=len, reverse=True)
