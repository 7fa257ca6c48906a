"""The data-plane rendezvous store: bound to one address, its keys under a per-run secret.

Rank 0 hosts a ``torch.distributed.TCPStore`` that every rank uses to find the others (gloo/NCCL
exchange their addresses through it). TCPStore itself listens on every interface and answers anyone
who connects, so Epochal narrows both: the listening socket is created here, bound to the address
rank 0 advertises (loopback for a single-machine run), and handed to the store; and every key the
process group uses lives under ``epochal/RUN_ID/SECRET/``, where SECRET is drawn by rank 0 and
travels only over the admitted control connections (``StoreReady`` to the coordinator, ``Welcome``
to each rank). A process that reaches the port without the secret can neither read a rank's
address nor plant one: the keys it could write are never read.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import secrets
import socket
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from epochal.log import WORKER

KEY_BYTES = 16
"""Random bytes in a run's store secret (hex-encoded on the wire)."""


def new_key() -> str:
    """A fresh store secret."""
    return secrets.token_hex(KEY_BYTES)


def open_store(host: str, timeout: float) -> TCPStore:
    """Rank 0: a TCPStore server listening on ``host`` only, on a port the kernel picks.

    When ``host`` is not an address of this machine (``EPOCHAL_HOST`` names a NAT's public
    address, say), the store listens on every interface, as torch's own does, and says so; its
    keys are still under the run's secret.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    own = host  # where the server's own client reaches it
    try:
        try:
            listener.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            wildcard, own = ("::", "::1") if family == socket.AF_INET6 else ("0.0.0.0", "127.0.0.1")
            listener.bind((wildcard, 0))
            WORKER.info(
                f"epochal: {host} is not an address of this machine, so the data-plane store "
                "listens on every interface (its keys are under the run's secret)"
            )
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        server = functools.partial(
            TCPStore,
            own,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=listener.fileno(),
        )
        try:
            store = server()
        except NotImplementedError:
            # torch before 2.8: its default (libuv) store cannot take a listening socket; the
            # older backend can, and serves a run's rendezvous as well
            store = server(use_libuv=False)
    except BaseException:
        with contextlib.suppress(OSError):  # the store may have closed it already
            listener.close()
        raise
    listener.detach()  # the store's server owns the descriptor now
    return store


def connect_store(host: str, port: int, timeout: float) -> TCPStore:
    """Any other rank: a client of rank 0's store."""
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def scoped(store: TCPStore, run_id: str, key: str) -> PrefixStore:
    """The view of ``store`` the process group uses: every key under the run's secret."""
    return PrefixStore(f"epochal/{run_id}/{key}" if key else f"epochal/{run_id}", store)
