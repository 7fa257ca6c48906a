"""Hosts made of Linux network namespaces, for tests that need more than one network stack.

``with hosts(3) as net:`` builds three hosts on one private layer-2 network and removes all of it
on the way out, even when the body raised::

    net[i].address                    # 198.18.X.(i+1), X chosen from the pid
    net[i].popen([...], env=...)      # runs `ip netns exec NAME ...` with this Python's env
    net[i].ip("link", "set", "eth0", "down")   # cut the host's link
    net[i].netem("delay", "50ms")     # shape its outgoing traffic (NetemUnavailable if no netem)
    net.impair(50, 1)                 # 50 ms and 1 % loss on every link: "netem" or "userspace"

Layout: the bridge lives in a namespace of its own; each host is a namespace with ``lo`` up and an
``eth0`` whose peer is a port of that bridge. Nothing is added to the root namespace, and only the
addresses of these hosts are ever used. Every host shares this machine's hostname and
``/etc/hosts``, so a hostname that resolves to loopback here does so on every test host too, as in
many containers. At the end every process still running in a host is killed, then the namespaces
are deleted. Needs root (``ip netns add``).

Impairment. ``net.impair(delay_ms, loss_percent)`` uses netem on every host's ``eth0`` when the
kernel has ``sch_netem``. Many VM and container kernels do not (``tc`` answers "Specified qdisc
kind is unknown", and there is no module to load); then the impairment is done in userspace:
the bridge's ports leave the bridge and ``switch.py``, a learning switch on ``AF_PACKET`` raw
sockets running in the bridge's namespace, forwards between them, delaying every frame by
``delay_ms`` and dropping it with probability ``loss_percent`` / 100 (seeded). Checksum and
segmentation offloads are turned off on the hosts' ``eth0`` for it, so that every frame it reads
is whole, checksummed and no larger than the MTU. With the checksum offload on, TCP does not
even connect: the sender leaves the checksum to the veth, which never computes it, so every
forwarded segment arrives with a bad checksum and is dropped. Turning that one off was enough
here; segmentation offloads are turned off too, so that no frame is larger than the MTU.

Each frame from one host to another is delayed once and lost with that probability once, as with
netem on the sender, so a round trip takes at least twice the delay. What it means for the numbers:
the switch adds a cost of its own. It is one Python process that shares the CPUs with the run. Idle,
it adds little: a UDP round trip through it without impairment took 0.033 ms here, against 0.035 ms
through the bridge. With 2 ms per hop the round trip took 4.34 ms rather than 4. Under training
traffic it competes with the run for the CPU, and TCP through it carries at most one core's worth of
frames. On this 2-core VM, the digits epoch took 1.54 times as long as on one host through the
switch without impairment, against 1.1 times through the bridge. With 50 ms of delay that is noise;
with 2 ms it is a visible part. So ``bench/multihost.py`` measures the switch without impairment as
a row of its own, with the round trip of each configuration. ``switch.py`` also counts what it
forwarded and lost (``net.stop_switch()``), so a test can check that it was in the path.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from epochal import zygote
from epochal.environment import PRELOAD_SOCKET_ENV
from epochal.launch.preload import CONNECT_TIMEOUT
from tests.forked import ForkedProcess, forkable

HOST_PRELOAD = str(Path(__file__).with_name("hostpreload.py"))
PRELOAD_START = 60.0
"""Seconds for a host's preloaded process to listen: it imports nothing (a hang, not a bound)."""
PREFIX = "198.18"  # RFC 2544 benchmark range: never routed, never anyone's real network
_networks = itertools.count()
SWITCH = str(Path(__file__).with_name("switch.py"))
SWITCH_START = 30.0  # seconds for the switch's interpreter to start and open its ports


class NetemUnavailable(RuntimeError):
    """The kernel has no netem queueing discipline, so delay and loss cannot be emulated."""


def own_prefix() -> str:
    """How the names of the namespaces this process makes begin: each test process (pytest-xdist
    runs several) makes and removes its own, so names never collide across them."""
    return f"ep{os.getpid()}n"


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add): run the multi-host tests as root"
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        return "the `ip` command (iproute2) is missing"
    return None


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


class Host:
    """One namespace: an address on the shared network and a way to run processes there."""

    def __init__(self, name: str, address: str, index: int) -> None:
        self.name = name
        self.address = address
        self.index = index
        self.procs: list[subprocess.Popen[Any]] = []
        self.preload: ForkedProcess | None = None
        self._preload_dir: str | None = None

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(
        self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (own session, so it and its children can be killed).

        ``env`` defaults to this process's environment; ``PYTHONPATH`` is carried either way.
        A leading ``python`` means this interpreter. A Python script or ``-m`` module whose
        output goes to a file is forked from this host's preloaded process (:meth:`preloaded`),
        and so is in the host as ``ip netns exec`` would put it; anything else is run through
        ``ip netns exec``.
        """
        argv = list(argv)
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        full = dict(os.environ) if env is None else dict(env)
        if "PYTHONPATH" in os.environ:
            full.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
        proc: Any
        server = os.environ.get(PRELOAD_SOCKET_ENV)
        if (
            server
            and argv[0] == sys.executable
            and forkable(argv[1:])
            and set(kwargs) <= {"stdout", "stderr", "cwd"}
            and kwargs.get("stderr") == subprocess.STDOUT
            and hasattr(kwargs.get("stdout"), "fileno")
        ):  # a Python program whose output goes to a file: forked, in this host
            proc = ForkedProcess(
                argv[1:],
                env=full,
                cwd=kwargs.get("cwd") or os.getcwd(),
                server=self.preloaded(server),
                stdout=kwargs["stdout"],
            )
        else:
            kwargs.setdefault("start_new_session", True)
            proc = subprocess.Popen(self.exec_argv(argv), env=full, **kwargs)
        self.procs.append(proc)
        return proc  # type: ignore[no-any-return]

    def preloaded(self, server: str) -> str:
        """The socket of this host's preloaded process, forked from the session's (``server``)
        the first time it is asked for (:mod:`tests.multihost.hostpreload`)."""
        if self.preload is not None:
            assert self._preload_dir is not None
            return os.path.join(self._preload_dir, "p.sock")
        self._preload_dir = tempfile.mkdtemp(prefix="eph", dir="/tmp")  # short: a socket's path
        path = os.path.join(self._preload_dir, "p.sock")
        channel, hello = zygote.connect(server, CONNECT_TIMEOUT)  # what it imported
        channel.close()
        with open(os.path.join(self._preload_dir, "log"), "w") as log:
            self.preload = ForkedProcess(
                [HOST_PRELOAD, self.name, path, *hello["modules"]],
                env=dict(os.environ),
                cwd="/",
                server=server,
                stdout=log,
            )
        deadline = time.monotonic() + PRELOAD_START
        while True:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                probe.connect(path)
                return path
            except OSError:
                if self.preload.poll() is not None or time.monotonic() > deadline:
                    said = Path(self._preload_dir, "log").read_text(errors="replace")
                    raise RuntimeError(
                        f"host {self.name}'s preloaded process did not listen on {path} "
                        f"(status {self.preload.poll()}):\n{said[-3000:]}"
                    ) from None
                time.sleep(0.05)
            finally:
                probe.close()

    def run(self, *argv: str) -> str:
        """Run a short command on this host; its stdout, or RuntimeError with its stderr."""
        return _run(*self.exec_argv(argv))

    def ip(self, *args: str) -> str:
        return self.run("ip", *args)

    def link(self, up: bool) -> None:
        """Plug or unplug this host's cable: ``ip link set eth0 up|down``."""
        self.ip("link", "set", "eth0", "up" if up else "down")

    def netem(self, *spec: str) -> None:
        """Shape what this host sends: ``netem("delay", "50ms", "loss", "1%")``."""
        try:
            self.run("tc", "qdisc", "add", "dev", "eth0", "root", "netem", *spec)
        except RuntimeError as exc:
            if "unknown" in str(exc).lower() or "no such file" in str(exc).lower():
                raise NetemUnavailable(
                    "this kernel has no netem queueing discipline (sch_netem), so link delay "
                    "and loss cannot be emulated here"
                ) from None
            raise

    def pids(self) -> list[int]:
        """Every process whose network namespace is this host's."""
        try:
            out = _run("ip", "netns", "pids", self.name)
        except RuntimeError:
            return []
        return [int(p) for p in out.split()]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        if self.preload is not None:  # killed above with every process of the host
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.preload.wait(timeout=10)
            self.preload = None
        if self._preload_dir is not None:
            shutil.rmtree(self._preload_dir, ignore_errors=True)
            self._preload_dir = None


class Network:
    """N hosts on one bridge; index it like a list."""

    def __init__(self, count: int) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"between 1 and 200 hosts, got {count}")
        seq = next(_networks)
        tag = f"{own_prefix()}{seq}"
        self.subnet = (os.getpid() + seq) % 256
        self.bridge = f"{tag}br"
        self.hosts = [
            Host(f"{tag}h{i}", f"{PREFIX}.{self.subnet}.{i + 1}", i) for i in range(count)
        ]
        self._made: list[str] = []
        self.switch: subprocess.Popen[str] | None = None
        self.impairment = "none"

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def build(self) -> None:
        self._netns(self.bridge)
        br = ["ip", "netns", "exec", self.bridge, "ip"]
        _run(*br, "link", "set", "lo", "up")
        _run(*br, "link", "add", "br0", "type", "bridge")
        _run(*br, "link", "set", "br0", "up")
        for host in self.hosts:
            self._netns(host.name)
            port = f"p{host.index}"  # the bridge's end, inside the bridge's namespace
            peer = ["peer", "name", "eth0", "netns", host.name]
            _run(*br, "link", "add", port, "type", "veth", *peer)
            _run(*br, "link", "set", port, "master", "br0")
            _run(*br, "link", "set", port, "up")
            host.ip("link", "set", "lo", "up")
            host.ip("addr", "add", f"{host.address}/24", "dev", "eth0")
            host.ip("link", "set", "eth0", "up")

    def impair(self, delay_ms: float, loss_percent: float, userspace: bool = False) -> str:
        """Delay every frame by ``delay_ms`` and lose ``loss_percent`` % of them, on every link.

        With netem (``tc qdisc ... netem`` on each host's ``eth0``) when the kernel has it and
        ``userspace`` is false; otherwise the bridge's ports are taken off the bridge and a
        userspace switch (``switch.py``) forwards between them, delaying and dropping each
        frame. Either way a frame from one host to another is delayed once and lost with the
        given probability once, so a round trip takes at least ``2 * delay_ms``. Returns
        ``"netem"`` or ``"userspace"`` (also kept in ``self.impairment``).
        """
        if not userspace:
            spec = ("delay", f"{delay_ms:g}ms", "loss", f"{loss_percent:g}%")
            shaped: list[Host] = []
            try:
                for host in self.hosts:
                    host.netem(*spec)
                    shaped.append(host)
                self.impairment = "netem"
                return self.impairment
            except NetemUnavailable:
                for host in shaped:  # all or none: a kernel has netem or does not
                    host.run("tc", "qdisc", "del", "dev", "eth0", "root")
        self.start_switch(delay_ms, loss_percent / 100.0)
        return self.impairment

    def start_switch(self, delay_ms: float, loss: float, seed: int = 1) -> None:
        """Replace the bridge by the userspace switch (see ``switch.py``), started here."""
        if self.switch is not None:
            raise RuntimeError("the userspace switch is already running on this network")
        for host in self.hosts:  # whole, checksummed frames no larger than the MTU
            host.run(sys.executable, SWITCH, "--offloads-off", "eth0")
        ports = [f"p{host.index}" for host in self.hosts]
        br = ["ip", "netns", "exec", self.bridge]
        for port in ports:
            _run(*br, "ip", "link", "set", port, "nomaster")
            _run(*br, "ip", "link", "set", port, "promisc", "on")
        argv = [*br, sys.executable, SWITCH, "--delay-ms", str(delay_ms), "--loss", str(loss)]
        argv += ["--seed", str(seed)]
        for port in ports:
            argv += ["--port", port]
        self.switch = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.switch.stdout is not None
        ready, _, _ = select.select([self.switch.stdout], [], [], SWITCH_START)
        line = self.switch.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.switch.kill()
            _, err = self.switch.communicate()
            raise RuntimeError(f"the userspace switch did not start: {line}{err}".strip())
        self.impairment = "userspace"

    def stop_switch(self) -> str:
        """Stop the userspace switch; its counters line (``forwarded=… lost=…``)."""
        if self.switch is None:
            return ""
        proc, self.switch = self.switch, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        return err.strip().splitlines()[-1] if err.strip() else ""

    def close(self) -> None:
        """Kill every process on every host, then delete the namespaces (veths go with them)."""
        if self.switch is not None:
            try:
                os.killpg(self.switch.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.switch.communicate()
            self.switch = None
        for host in self.hosts:
            if host.name in self._made:
                host.kill_all()
        for name in reversed(self._made):
            for _ in range(50):  # a process just killed may hold the namespace for a moment
                done = subprocess.run(["ip", "netns", "del", name], capture_output=True)
                if done.returncode == 0:
                    break
                time.sleep(0.1)
        self._made.clear()

    def leftover(self) -> list[int]:
        """Processes still alive on any host (a test asserts this is empty before it ends),
        but for the hosts' preloaded processes, which serve until the network is removed."""
        return [
            pid
            for host in self.hosts
            for pid in host.pids()
            if host.preload is None or pid != host.preload.pid
        ]


@contextmanager
def hosts(count: int) -> Iterator[Network]:
    """``count`` hosts on one private network, removed on exit whatever happened."""
    net = Network(count)
    try:
        net.build()
        yield net
    finally:
        net.close()
