"""Which address and interface the data plane uses: the rule as a table, then this machine."""

from __future__ import annotations

import pytest

from epochal.errors import ConfigError
from epochal.worker.dataplane import network
from epochal.worker.dataplane.network import DataPlane, apply, choose

HOST = {"lo": "127.0.0.1", "eth0": "10.0.0.7", "ib0": "192.168.5.7"}
REMOTE = dict(coordinator_host="coord", coordinator_address="10.0.0.1", route_address="10.0.0.7")
GLOO_IB0 = {"GLOO_SOCKET_IFNAME": "ib0"}
LOCAL = dict(coordinator_host="127.0.0.1", coordinator_address="127.0.0.1", route_address=None)


@pytest.mark.parametrize(
    ("env", "where", "address", "ifname"),
    [
        # no hints: the interface of the route to the coordinator, never the hostname's loopback
        ({}, REMOTE, "10.0.0.7", "eth0"),
        # a coordinator on loopback: one machine
        ({}, LOCAL, "127.0.0.1", "lo"),
        ({}, {**LOCAL, "coordinator_host": "localhost"}, "127.0.0.1", "lo"),
        ({}, {**LOCAL, "coordinator_address": "0.0.0.0"}, "127.0.0.1", "lo"),
        # EPOCHAL_IFNAME picks the interface and its address
        ({"EPOCHAL_IFNAME": "ib0"}, REMOTE, "192.168.5.7", "ib0"),
        # EPOCHAL_HOST picks the address; the interface that holds it goes with it
        ({"EPOCHAL_HOST": "192.168.5.7"}, REMOTE, "192.168.5.7", "ib0"),
        # an address no interface holds (NAT, a name): advertised; gloo binds the routed interface
        ({"EPOCHAL_HOST": "node7.example"}, REMOTE, "node7.example", "eth0"),
        # both: the address from EPOCHAL_HOST, the interface from EPOCHAL_IFNAME
        ({"EPOCHAL_HOST": "203.0.113.9", "EPOCHAL_IFNAME": "eth0"}, REMOTE, "203.0.113.9", "eth0"),
        # a user who names an address on a one-machine run gets it
        ({"EPOCHAL_HOST": "10.1.2.3"}, LOCAL, "10.1.2.3", None),
        # a coordinator name that does not resolve here still counts as remote
        ({}, {**REMOTE, "coordinator_address": None, "route_address": None}, None, None),
    ],
)
def test_the_choice(env, where, address, ifname):
    if address is None:
        with pytest.raises(ConfigError, match=r"no route to the coordinator at coord.*IFNAME"):
            choose(env=env, interfaces=HOST, **where)
        return
    choice = choose(env=env, interfaces=HOST, **where)
    assert (choice.address, choice.ifname) == (address, ifname)


@pytest.mark.parametrize(
    "env",
    [{"EPOCHAL_HOST": "127.0.0.1"}, {"EPOCHAL_IFNAME": "lo"}, {"EPOCHAL_HOST": "127.0.1.1"}],
)
def test_loopback_with_a_remote_coordinator_is_refused_saying_what_to_set(env):
    with pytest.raises(ConfigError) as err:
        choose(env=env, interfaces=HOST, **REMOTE)
    message = str(err.value)
    assert "loopback" in message and "coord" in message
    assert "EPOCHAL_IFNAME" in message and "EPOCHAL_HOST" in message


def test_a_route_over_loopback_to_a_remote_coordinator_is_refused():
    with pytest.raises(ConfigError, match=r"loopback address 127\.0\.0\.1"):
        choose(env={}, interfaces=HOST, **{**REMOTE, "route_address": "127.0.0.1"})


def test_an_unknown_interface_is_named_with_the_ones_there_are():
    with pytest.raises(ConfigError, match=r"EPOCHAL_IFNAME='eth9'.*eth0 \(10.0.0.7\)"):
        choose(env={"EPOCHAL_IFNAME": "eth9"}, interfaces=HOST, **REMOTE)


@pytest.mark.parametrize(
    ("env", "set_now", "after"),
    [
        ({}, {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}, None),
        # the libraries' own variables, set by the user, win
        ({"GLOO_SOCKET_IFNAME": "ib0"}, {"NCCL_SOCKET_IFNAME": "eth0"}, GLOO_IB0),
        ({"NCCL_SOCKET_IFNAME": "^docker"}, {"GLOO_SOCKET_IFNAME": "eth0"}, None),
        ({"GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"}, {}, None),
    ],
)
def test_gloo_and_nccl_get_the_interface_unless_already_set(env, set_now, after):
    before = dict(env)
    assert apply(DataPlane("10.0.0.7", "eth0", "test"), env) == set_now
    assert env == {**before, **set_now}
    if after:
        assert all(env[k] == v for k, v in after.items())


def test_no_interface_sets_nothing():
    env: dict[str, str] = {}
    assert apply(DataPlane("node7.example", None, "test"), env) == {} and env == {}


def test_this_machine_loopback_coordinator(monkeypatch):
    monkeypatch.delenv("EPOCHAL_HOST", raising=False)
    monkeypatch.delenv("EPOCHAL_IFNAME", raising=False)
    assert network.interfaces()["lo"] == "127.0.0.1"
    assert network.discover("tcp://127.0.0.1:4000") == DataPlane("127.0.0.1", "lo", "one machine")
    assert network.discover("ipc:///tmp/x.sock").address == "127.0.0.1"


def test_this_machine_names_the_interface_of_the_route():
    found = network.interfaces()
    for name, address in found.items():
        if name != "lo":  # the route to our own address leaves from that address
            assert network.route_address(address) == address
