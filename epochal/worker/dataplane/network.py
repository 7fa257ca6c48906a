"""Which network the data plane uses: the address rank 0 advertises its store at, and the
interface gloo and NCCL bind.

A machine's hostname often resolves to a loopback address (container images, cloud images,
``/etc/hosts`` with ``127.0.1.1 host``); gloo, left alone, advertises that address and peers on
other machines dial ``127.0.0.1``. So the worker picks the network the control connection uses:
the local address of the route to the coordinator, and the interface holding it, unless the user
names one. :func:`choose` is the rule (pure, table-tested); :func:`discover` gathers its inputs
from this machine and :func:`apply` hands the interface to gloo and NCCL through their own
environment variables, which a user who set them keeps.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from epochal.environment import HOST_ENV, IFNAME_ENV
from epochal.errors import ConfigError
from epochal.rundir.addressfile import interface_addresses

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""gloo's own choice of interface(s); when set, gloo uses it and epochal leaves it alone."""

NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"
"""NCCL's interface for its bootstrap and socket transport; kept when the user set it."""


@dataclass(frozen=True, slots=True)
class DataPlane:
    """Where this worker's data plane lives."""

    address: str
    # the IPv4 address peers reach this machine at (rank 0 advertises its store there)
    ifname: str | None
    # the interface holding it, given to gloo and NCCL; None: none of ours holds the address
    source: str
    # why this choice, for messages: "EPOCHAL_HOST", "EPOCHAL_IFNAME", "route to HOST", ...


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address == "localhost"
    return ip.is_loopback or ip.is_unspecified  # 0.0.0.0 reaches this machine too


def _interface_of(address: str, interfaces: Mapping[str, str]) -> str | None:
    return next((name for name, addr in interfaces.items() if addr == address), None)


def choose(
    *,
    env: Mapping[str, str],
    coordinator_host: str,
    coordinator_address: str | None,
    route_address: str | None,
    interfaces: Mapping[str, str],
) -> DataPlane:
    """The data-plane address and interface, from the user's settings and this machine's network.

    ``coordinator_host`` is the host in the coordinator's endpoint, ``coordinator_address`` what
    it resolves to (None: it does not), ``route_address`` the local address of the route to it
    (None: no route), ``interfaces`` every interface's IPv4 address by name. Precedence:
    ``EPOCHAL_HOST`` (the address), then ``EPOCHAL_IFNAME`` (the interface), then the route to the
    coordinator; a coordinator on loopback means one machine: ``127.0.0.1`` on ``lo``.
    Raises ConfigError for a named interface that does not exist and for a loopback choice while
    the coordinator is on another machine (the peers could never reach it).
    """
    remote = coordinator_address is not None and not _is_loopback(coordinator_address)
    if coordinator_address is None and not _is_loopback(coordinator_host):
        remote = True
    explicit_host = env.get(HOST_ENV, "")
    explicit_if = env.get(IFNAME_ENV, "")
    if explicit_if and explicit_if not in interfaces:
        known = ", ".join(f"{n} ({a})" for n, a in sorted(interfaces.items())) or "none"
        raise ConfigError(
            f"{IFNAME_ENV}={explicit_if!r} names no interface with an IPv4 address on this "
            f"machine; it has: {known}"
        )
    routed_if = _interface_of(route_address, interfaces) if remote and route_address else None
    if explicit_host:
        # gloo and NCCL can only bind an address of this machine: with an address none of its
        # interfaces holds (NAT), they still bind the interface that reaches the coordinator
        held_by = explicit_if or _interface_of(explicit_host, interfaces) or routed_if
        choice = DataPlane(explicit_host, held_by, HOST_ENV)
    elif explicit_if:
        choice = DataPlane(interfaces[explicit_if], explicit_if, IFNAME_ENV)
    elif not remote:
        choice = DataPlane("127.0.0.1", _interface_of("127.0.0.1", interfaces), "one machine")
    elif route_address is not None:
        choice = DataPlane(
            route_address, routed_if, f"the route to the coordinator at {coordinator_host}"
        )
    else:
        raise ConfigError(
            f"this machine has no route to the coordinator at {coordinator_host}, so the data "
            f"plane cannot pick a network: set {IFNAME_ENV} to the interface the other workers "
            f"reach this machine on (or {HOST_ENV} to its address)"
        )
    if remote and _is_loopback(choice.address):
        raise ConfigError(
            f"the data plane would use the loopback address {choice.address} (from "
            f"{choice.source}) while the coordinator at {coordinator_host} is on another "
            f"machine, so no other worker could reach this one: set {IFNAME_ENV} to the "
            f"interface the other workers reach this machine on (or {HOST_ENV} to its address)"
        )
    return choice


def apply(choice: DataPlane, env: MutableMapping[str, str]) -> dict[str, str]:
    """Point gloo and NCCL at ``choice.ifname`` in ``env`` unless the user set them; what was set.

    Both libraries read their variable when the process group is created, so this runs before
    ``init_process_group``.
    """
    set_now: dict[str, str] = {}
    if choice.ifname is None:
        return set_now
    for name in (GLOO_IFNAME_ENV, NCCL_IFNAME_ENV):
        if not env.get(name):
            env[name] = choice.ifname
            set_now[name] = choice.ifname
    return set_now


# ---------------------------------------------------------------------- this machine


def interfaces() -> dict[str, str]:
    """Every interface of this machine that has an IPv4 address, by name."""
    return interface_addresses()


def route_address(address: str) -> str | None:
    """The local address this machine sends from to reach ``address`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def discover(endpoint: str, env: Mapping[str, str] | None = None) -> DataPlane:
    """:func:`choose` with this machine's network and the coordinator at ``endpoint``."""
    parts = urlsplit(endpoint)
    # ipc:// or inproc://: the coordinator is on this machine
    host = (parts.hostname if parts.scheme == "tcp" else None) or "127.0.0.1"
    resolved = _resolve(host)
    return choose(
        env=os.environ if env is None else env,
        coordinator_host=host,
        coordinator_address=resolved,
        route_address=route_address(resolved) if resolved is not None else None,
        interfaces=interfaces(),
    )
