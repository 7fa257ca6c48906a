"""The test hosts themselves: they reach each other, a cut link cuts, and nothing outlives them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multihost import netns
from tests.waiting import wait_until

SERVE = "import socket,sys; s=socket.create_server((sys.argv[1], 7000)); print('up', flush=True); "
SERVE += "c,_=s.accept(); c.sendall(b'hello')"
DIAL = "import socket,sys; print(socket.create_connection((sys.argv[1], 7000), timeout=3).recv(5))"


def namespaces() -> set[str]:
    """The network namespaces this process made (other test processes make their own)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return {name for name in names if name.startswith(netns.own_prefix())}


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
        # `ip netns exec` enters the namespace, then execs
        wait_until(
            lambda: sleeper.pid in net[0].pids(), 10, "the process never showed up in its host"
        )
        raise RuntimeError("the test failed")
    assert sleeper.poll() is not None
    assert namespaces() == before


def test_a_cut_link_stops_traffic(make_hosts):
    net = make_hosts(2)
    net[1].link(up=False)
    with pytest.raises(RuntimeError):
        net[1].run(sys.executable, "-c", DIAL, net[0].address)


PROBE = str(Path(netns.__file__).with_name("probe.py"))


def probe(host: netns.Host, *args: str) -> dict:
    return json.loads(host.run("python", PROBE, *args))


def started(host: netns.Host, *args: str) -> subprocess.Popen[str]:
    proc = host.popen(["python", PROBE, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_the_userspace_switch_delays_and_drops_every_frame(make_hosts):
    """Round trips take two delays or more; about the configured share of datagrams is lost."""
    delay_ms, loss = 20.0, 0.1
    net = make_hosts(2)
    assert net.impair(delay_ms, 100 * loss, userspace=True) == "userspace"
    started(net[1], "echo", "7000")
    # a lost probe (or its echo) is given up after 0.5 s, twelve round trips, and counted as lost,
    # which nothing here checks: only the round trips that came back are
    rtt = probe(net[0], "rtt", net[1].address, "7000", "--count", "30", "--timeout", "0.5")
    assert rtt["rtts"] and min(rtt["rtts"]) >= 2 * delay_ms / 1000, rtt
    sink = started(net[1], "sink", "7001", "--idle", "30")  # it stops at the sender's end mark
    sends = 1000
    probe(net[0], "send", net[1].address, "7001", "--count", str(sends), "--interval", "0.001")
    out, _ = sink.communicate(timeout=60)
    lost = sends - json.loads(out)["received"]
    # expected 100, standard deviation 9.5: 40..160 is more than six deviations either way
    assert 0.4 * loss * sends <= lost <= 1.6 * loss * sends, lost
    counts = dict(kv.split("=") for kv in net.stop_switch().split())
    assert int(counts["overflow"]) == int(counts["oversize"]) == int(counts["unread"]) == 0, counts


def test_the_userspace_switch_carries_tcp_whole_and_in_order(make_hosts):
    """A bulk TCP transfer (full-size frames, offloads off) arrives intact through the switch."""
    net = make_hosts(2)
    net.impair(1.0, 0.0, userspace=True)
    serve = "import hashlib,socket; s=socket.create_server(('0.0.0.0', 7002)); print('ready', "
    serve += "flush=True); c,_=s.accept(); h=hashlib.sha256()\nwhile b:=c.recv(65536): h.update(b)"
    serve += "\nprint(h.hexdigest())"
    server = net[1].popen(["python", "-c", serve], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    data = "bytes(range(256)) * 8192"  # 2 MiB in 1448-byte segments
    dial = f"socket.create_connection(('{net[1].address}', 7002), timeout=30)"  # no hang
    send = f"import socket; {dial}.sendall({data})"
    net[0].run("python", "-c", send)
    out, _ = server.communicate(timeout=60)
    assert out.strip() == hashlib.sha256(bytes(range(256)) * 8192).hexdigest()
    counts = dict(kv.split("=") for kv in net.stop_switch().split())
    assert int(counts["forwarded"]) > 1400 and int(counts["oversize"]) == 0, counts


def test_a_failing_body_still_stops_the_switch(make_hosts):
    before = namespaces()
    with pytest.raises(RuntimeError, match="the test failed"), netns.hosts(2) as net:
        net.impair(0.0, 0.0, userspace=True)
        assert net.switch is not None
        switch = net.switch.pid
        raise RuntimeError("the test failed")
    with pytest.raises(ProcessLookupError):
        os.kill(switch, 0)
    assert namespaces() == before
