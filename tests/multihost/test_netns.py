"""The test hosts themselves: they reach each other, a cut link cuts, and nothing outlives them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multihost import netns

SERVE = "import socket,sys; s=socket.create_server((sys.argv[1], 7000)); print('up', flush=True); "
SERVE += "c,_=s.accept(); c.sendall(b'hello')"
DIAL = "import socket,sys; print(socket.create_connection((sys.argv[1], 7000), timeout=3).recv(5))"


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_not_root_is_a_clear_skip_reason(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "need root" in (netns.available() or "")


def test_hosts_reach_each_other_and_everything_goes_away(make_hosts):
    before = namespaces()
    with netns.hosts(2) as net:
        assert net[0].address != net[1].address
        assert net[0].address.startswith("198.18.")
        made = namespaces() - before
        assert {h.name for h in net} | {net.bridge} == made
        server = net[0].popen(["python", "-c", SERVE, net[0].address], stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline() == b"up\n"
        out = net[1].run(sys.executable, "-c", DIAL, net[0].address)
        assert out.strip() == "b'hello'"
        assert server.wait(timeout=10) == 0
        server.stdout.close()
        # host 1 cannot reach the root namespace's own addresses: it is a host of its own
        assert "eth0" in net[1].ip("-br", "addr") and net[1].ip("route").count("default") == 0
    assert namespaces() == before


def test_a_failing_body_still_kills_its_processes_and_removes_the_hosts(make_hosts):
    before = namespaces()
    with pytest.raises(RuntimeError, match="the test failed"), netns.hosts(1) as net:
        sleeper = net[0].popen(["sleep", "600"])
        pids = net[0].pids()
        assert sleeper.pid in pids
        raise RuntimeError("the test failed")
    assert sleeper.poll() is not None
    assert namespaces() == before


def test_a_cut_link_stops_traffic(make_hosts):
    net = make_hosts(2)
    net[1].link(up=False)
    with pytest.raises(RuntimeError):
        net[1].run(sys.executable, "-c", DIAL, net[0].address)
