"""Hosts made of Linux network namespaces, for tests that need more than one network stack.

``with hosts(3) as net:`` builds three hosts on one private layer-2 network and removes all of it
on the way out, even when the body raised::

    net[i].address                    # 198.18.X.(i+1), X chosen from the pid
    net[i].popen([...], env=...)      # runs `ip netns exec NAME ...` with this Python's env
    net[i].ip("link", "set", "eth0", "down")   # cut the host's link
    net[i].netem("delay", "50ms")     # shape its outgoing traffic (NetemUnavailable if no netem)

Layout: the bridge lives in a namespace of its own; each host is a namespace with ``lo`` up and an
``eth0`` whose peer is a port of that bridge. Nothing is added to the root namespace, and only the
addresses of these hosts are ever used. Every host shares this machine's hostname and
``/etc/hosts``, so a hostname that resolves to loopback here does so on every test host too, as in
many containers. At the end every process still running in a host is killed, then the namespaces
are deleted. Needs root (``ip netns add``).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

PREFIX = "198.18"  # RFC 2544 benchmark range: never routed, never anyone's real network
_networks = itertools.count()


class NetemUnavailable(RuntimeError):
    """The kernel has no netem queueing discipline, so delay and loss cannot be emulated."""


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

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(
        self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (own session, so it and its children can be killed).

        ``env`` defaults to this process's environment; ``PYTHONPATH`` is carried either way.
        A leading ``python`` means this interpreter.
        """
        argv = list(argv)
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        full = dict(os.environ) if env is None else dict(env)
        if "PYTHONPATH" in os.environ:
            full.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.exec_argv(argv), env=full, **kwargs)
        self.procs.append(proc)
        return proc

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


class Network:
    """N hosts on one bridge; index it like a list."""

    def __init__(self, count: int) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"between 1 and 200 hosts, got {count}")
        seq = next(_networks)
        tag = f"ep{os.getpid()}n{seq}"
        self.subnet = (os.getpid() + seq) % 256
        self.bridge = f"{tag}br"
        self.hosts = [
            Host(f"{tag}h{i}", f"{PREFIX}.{self.subnet}.{i + 1}", i) for i in range(count)
        ]
        self._made: list[str] = []

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

    def close(self) -> None:
        """Kill every process on every host, then delete the namespaces (veths go with them)."""
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
        """Processes still alive on any host (a test asserts this is empty before it ends)."""
        return [pid for host in self.hosts for pid in host.pids()]


@contextmanager
def hosts(count: int) -> Iterator[Network]:
    """``count`` hosts on one private network, removed on exit whatever happened."""
    net = Network(count)
    try:
        net.build()
        yield net
    finally:
        net.close()
