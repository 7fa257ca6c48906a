"""The coordinator's address file: what is written, atomically, and how workers wait for it."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from epochal.errors import ConfigError, CoordinatorUnreachable
from epochal.rundir import addressfile

ROUTES = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    "eth1\t0013C6C6\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
    "eth0\t00000000\t0113C6C6\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
)


def test_default_route_interface_is_parsed_from_the_route_table() -> None:
    assert addressfile.default_route_interface(ROUTES) == "eth0"
    only_local = ROUTES.splitlines()[0] + "\n" + ROUTES.splitlines()[1]
    assert addressfile.default_route_interface(only_local) is None


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://0.0.0.0:4321", "tcp://198.19.7.1:4321"),
        ("tcp://*:4321", "tcp://198.19.7.1:4321"),
        ("tcp://10.1.2.3:4321", "tcp://10.1.2.3:4321"),  # bound to one address: that one
        ("tcp://127.0.0.1:4321", "tcp://127.0.0.1:4321"),
        ("ipc:///tmp/x.sock", "ipc:///tmp/x.sock"),
    ],
)
def test_connectable_replaces_only_a_wildcard(endpoint: str, expected: str) -> None:
    assert addressfile.connectable(endpoint, {"EPOCHAL_HOST": "198.19.7.1"}) == expected


def test_connectable_never_writes_a_wildcard_without_hints() -> None:
    # this machine's own address: whatever it is, it is neither a wildcard nor loopback
    try:
        endpoint = addressfile.connectable("tcp://0.0.0.0:4321", {})
    except ConfigError as exc:  # a machine with no address but loopback: the error says what to set
        assert "EPOCHAL_HOST" in str(exc)
        return
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    address = ipaddress.ip_address(host)
    assert not address.is_unspecified and not address.is_loopback


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.addr"
    path.write_text("tcp://10.0.0.1:1\n")
    addressfile.write(path, "tcp://10.0.0.2:2")
    assert path.read_text() == "tcp://10.0.0.2:2\n"
    assert os.listdir(tmp_path) == ["coordinator.addr"]


def test_remove_if_ours_keeps_a_successors_file(tmp_path: Path) -> None:
    path = tmp_path / "a"
    addressfile.write(path, "tcp://10.0.0.2:2")
    addressfile.remove_if_ours(path, "tcp://10.0.0.9:9")
    assert path.exists()
    addressfile.remove_if_ours(path, "tcp://10.0.0.2:2")
    assert not path.exists()
    addressfile.remove_if_ours(path, "tcp://10.0.0.2:2")  # gone already: nothing to do


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ("tcp://1.2.3.4:5", None),
        ("file:/shared/c.addr", Path("/shared/c.addr")),
        ("file:///shared/c.addr", Path("/shared/c.addr")),
        ("file:relative/c.addr", Path("relative/c.addr")),
    ],
)
def test_file_path(spec: str, path: Path | None) -> None:
    assert addressfile.file_path(spec) == path


def test_file_path_without_a_path_is_refused() -> None:
    with pytest.raises(ConfigError, match="names no file"):
        addressfile.file_path("file:")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_for_says_once_and_reads_the_file_when_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "c.addr"
    clock = FakeClock()
    said: list[str] = []

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 1.0:
            addressfile.write(path, "tcp://10.0.0.3:3")

    got = addressfile.wait_for(path, 5.0, say=said.append, clock=clock, sleep=sleep)
    assert got == "tcp://10.0.0.3:3"
    assert len(said) == 1 and str(path) in said[0] and "5 s" in said[0]


def test_wait_for_gives_up_at_the_deadline(tmp_path: Path) -> None:
    clock = FakeClock()
    with pytest.raises(CoordinatorUnreachable, match=r"did not appear within 2 s.*--address-file"):
        addressfile.wait_for(tmp_path / "never", 2.0, clock=clock, sleep=clock.sleep)
    assert clock.now == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("explicit", "route", "host_name", "interfaces", "expected"),
    [
        ("10.9.9.9", "10.0.0.2", ["10.0.0.3"], ["10.0.0.4"], "10.9.9.9"),
        ("", "10.0.0.2", ["10.0.0.3"], ["10.0.0.4"], "10.0.0.2"),
        # no default route (a private network, a namespace): the host name, if not loopback
        ("", None, ["127.0.1.1", "10.0.0.3"], ["10.0.0.4"], "10.0.0.3"),
        # the host name maps to loopback, as in many images: an interface's address
        ("", None, ["127.0.1.1"], ["127.0.0.1", "198.19.0.5"], "198.19.0.5"),
        ("", "127.0.0.1", [], ["127.0.0.1"], None),
        ("", None, [], [], None),
    ],
)
def test_pick_address(
    explicit: str,
    route: str | None,
    host_name: list[str],
    interfaces: list[str],
    expected: str | None,
) -> None:
    got = addressfile.pick_address(
        explicit=explicit, route=route, host_name=host_name, interfaces=interfaces
    )
    assert got == expected
