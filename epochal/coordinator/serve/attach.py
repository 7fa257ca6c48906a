"""What a standalone coordinator tells the person who must attach workers to it.

A coordinator bound to every interface (``tcp://0.0.0.0:PORT``) cannot be dialled at that
address from another machine, and one that requires CURVE admits no worker that lacks its two
key variables. :func:`attach_hint` writes the command a worker machine needs: an address it can
dial and, with CURVE, the key variables with their files. Pure, so it is tested without sockets;
:func:`local_address` is the one lookup it needs.
"""

from __future__ import annotations

import socket
from pathlib import Path

from epochal.environment import COORDINATOR_ENV, CURVE_KEY_ENV, CURVE_SERVER_KEY_ENV
from epochal.errors import ConfigError
from epochal.rundir import addressfile

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
"""Hosts of a bind address that mean "every interface": not an address anyone can dial."""


def local_address() -> str:
    """This machine's address as other machines reach it
    (:func:`epochal.rundir.addressfile.local_address`:
    ``EPOCHAL_HOST``, else the default route's), else its host name."""
    try:
        return addressfile.local_address()
    except ConfigError:
        return socket.gethostname()


def connectable(endpoint: str, address: str) -> tuple[str, bool]:
    """``endpoint`` with a wildcard host replaced by ``address``; True when it was replaced."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or host not in WILDCARD_HOSTS:
        return endpoint, False
    return f"tcp://{address}:{port}", True


def attach_hint(
    endpoint: str,
    *,
    address: str,
    server_secret_key: Path | None = None,
    allowed_dir: Path | None = None,
) -> str:
    """The lines that tell how to attach a worker to the coordinator at ``endpoint``.

    ``address``: this machine's address (:func:`local_address`), put in place of a wildcard
    host. ``server_secret_key`` and ``allowed_dir``: the coordinator's CURVE flags, when given.
    """
    target, replaced = connectable(endpoint, address)
    variables = [f"{COORDINATOR_ENV}={target}"]
    notes = []
    if replaced:
        notes.append(
            f"{address} is this machine's address on its default route; if the workers' machines "
            "reach it by another name or address, use that"
        )
    if server_secret_key is not None:
        keys = server_secret_key.parent
        workers = (allowed_dir.parent if allowed_dir is not None else keys) / "workers"
        variables += [
            f"{CURVE_SERVER_KEY_ENV}={keys / 'coordinator.key'}",
            f"{CURVE_KEY_ENV}={workers / 'NAME.key_secret'}",
        ]
        notes.append(
            "copy coordinator.key to every worker machine, and each worker's NAME.key_secret to "
            "its own machine only; the paths above are where `epochal keys generate` wrote them"
        )
    lines = ["attach workers with: " + " ".join(variables) + " python SCRIPT"]
    lines += [f"  ({note})" for note in notes]
    return "\n".join(lines)
