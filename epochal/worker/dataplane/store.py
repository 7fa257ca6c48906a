"""The data-plane rendezvous store: bound to one address, its keys under a per-run secret, its
memory capped in a process of its own.

Rank 0 hosts a ``torch.distributed.TCPStore`` that every rank uses to find the others (gloo/NCCL
exchange their addresses through it). TCPStore itself listens on every interface, answers anyone
who connects and keeps whatever they send, so Epochal narrows all three:

- the listening socket is created here, bound to the address rank 0 advertises (loopback for a
  single-machine run), and handed to the store;
- every key the process group uses lives under ``epochal/RUN_ID/SECRET/``, where SECRET is drawn
  by rank 0 and travels only over the admitted control connections (``StoreReady`` to the
  coordinator, ``Welcome`` to each rank): a process that reaches the port without the secret can
  neither read a rank's address nor plant one, since the keys it could write are never read;
- the store's server runs in a process of its own
  (:mod:`epochal.worker.dataplane.storeserver`) whose data is capped (``RLIMIT_DATA``) at its
  start-up footprint plus
  :func:`~epochal.worker.dataplane.storeserver.budget`: 64 MiB + 16 KiB per rank + 16 bytes per rank
  squared (64 MiB for a few ranks, 95 MiB at 1,000, 1.7 GiB at 10,000). Nothing a stranger sends
  can make it hold more, nor make the training process hold any of it.

Why a cap and not a sweep: torch's server (2.13) keeps data a sweep cannot see or free. Values
pushed with ``queue_push`` are listed by neither ``list_keys`` nor ``num_keys`` and are not
removed by ``delete_key`` (measured: 128 MiB queued, ``list_keys() == []``, +168 MiB of memory);
an unfinished ``multi_set`` (up to 131,072 values of 8 MiB each) is buffered whole before any
reply, at about twice its size, and parsed again from its start at every 4 KiB read (32 MiB took
30 s of the server's thread). A process that deletes foreign keys every so often bounds none of
that; a limit on the process's memory bounds all of it.

Cost: the server process imports torch (about 2.5 s and 220 MiB of resident memory on a loaded
2-core machine, most of it torch's libraries, shared with rank 0's) once per run, while the other
ranks wait for the store; the store itself is the same libuv server as torch's, so each of the
rendezvous' reads costs what it did (``bench/store_rendezvous.py``). What the cap does not
prevent: a stranger who fills the store to it makes the store refuse further requests, so a
rendezvous still under way then fails (its ranks report the store's error and the run aborts);
a process group already formed does not use the store and runs on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import select
import socket
import subprocess
import sys
import time
import weakref
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from epochal.environment import PRELOAD_SOCKET_ENV
from epochal.errors import EpochalError
from epochal.log import WORKER
from epochal.worker.dataplane import storeserver
from epochal.zygote import CHANNEL_ENV, Child, channel_from, connect, popen

KEY_BYTES = 16
"""Random bytes in a run's store secret (hex-encoded on the wire)."""

LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
"""torch's C++ log level: the server process logs errors only (unless the user set it), since each
connection a stranger makes fail would otherwise be a warning on rank 0's output."""


def new_key() -> str:
    """A fresh store secret."""
    return secrets.token_hex(KEY_BYTES)


def _listen(host: str) -> tuple[socket.socket, str]:
    """A socket listening on ``host`` on a port the kernel picks, and the address the server's own
    client reaches it at.

    When ``host`` is not an address of this machine (``EPOCHAL_HOST`` names a NAT's public
    address, say), the socket listens on every interface, as torch's own store does, and says so;
    the keys are still under the run's secret.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    own = host
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
    except BaseException:
        listener.close()
        raise
    return listener, own


class StoreServer:
    """Rank 0's store server: a process of its own, serving on a socket bound here, its memory
    capped (see the module docstring). It ends when :meth:`close` is called, when this object is
    collected, or when this process ends, however it ends (its standard input closes)."""

    def __init__(
        self,
        process: subprocess.Popen[bytes] | Child,
        host: str,
        port: int,
        baseline: int,
    ):
        self.process = process
        self.host = host
        # where this machine's clients reach the server
        self.port = port
        self.baseline = baseline
        # the server's data once started, in bytes; the cap is this plus the budget
        self.limit = baseline + storeserver.budget(None)
        self._close = weakref.finalize(self, _end, process)

    @classmethod
    def start(cls, host: str, timeout: float) -> StoreServer:
        """Bind on ``host``, start the server process, and return once it serves (EpochalError
        if it does not within ``timeout`` seconds, with its exit status if it ended)."""
        listener, own = _listen(host)
        port = listener.getsockname()[1]
        env = dict(os.environ)
        env.setdefault(LOG_LEVEL_ENV, "ERROR")
        env.pop(CHANNEL_ENV, None)  # this process's, not the server's
        args = [str(listener.fileno()), own, str(port), str(timeout), str(os.getpid())]
        process: subprocess.Popen[bytes] | Child | None = None
        try:
            channel = channel_from() or _shared(timeout)
            if channel is not None:  # forked from the process that imported torch for the run
                try:
                    process = popen(
                        channel,
                        storeserver.__file__,
                        args,
                        env=env,
                        stdin=True,
                        stdout=True,
                        pass_fds=(listener.fileno(),),
                    )
                except OSError as exc:  # refused (zygote.server.fork_hazard), or it has ended
                    WORKER.info("%s; the store server imports torch itself", exc)
            if process is None:
                process = subprocess.Popen(
                    # -P: never import from the script's directory (this package's modules)
                    [sys.executable, "-P", storeserver.__file__, *args],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    pass_fds=(listener.fileno(),),
                    env=env,
                )
        finally:
            listener.close()  # the server holds it now: if it ends, connections are refused
        try:
            baseline = _ready(process, timeout)
        except BaseException:
            _end(process)
            raise
        return cls(process, own, port, baseline)

    def expect(self, world_size: int) -> None:
        """The run has ``world_size`` ranks: raise the cap by their share of the budget."""
        with contextlib.suppress(ProcessLookupError):  # it ended: connections say so
            self.limit = storeserver.cap(self.process.pid, self.baseline, world_size)

    def connect(self, timeout: float) -> TCPStore:
        """This process's client of the server."""
        return connect_store(self.host, self.port, timeout)

    def close(self) -> None:
        """End the server process (idempotent)."""
        self._close()


def _shared(timeout: float) -> socket.socket | None:
    """A channel to the preloaded process ``EPOCHAL_PRELOAD_SOCKET`` names (``epochal preload``),
    for a process that was not forked by one (a worker started by hand): it forks the store
    server rather than have a fresh interpreter import torch for it. None where there is none,
    or it cannot serve this process (another user's, another interpreter, another network)."""
    path = os.environ.get(PRELOAD_SOCKET_ENV)
    if not path:
        return None
    try:
        channel, _ = connect(path, timeout)
    except OSError:
        return None
    return channel


def _ready(process: subprocess.Popen[bytes] | Child, timeout: float) -> int:
    """The baseline the server process reports once it serves; EpochalError if it does not."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([process.stdout], [], [], left)[0]:
            raise EpochalError(
                f"the data-plane store did not start within {timeout:g} s (a machine this "
                "loaded needs a larger collective_timeout)"
            )
        chunk = os.read(process.stdout.fileno(), 64)
        if not chunk:
            status = process.wait()
            raise EpochalError(
                f"the data-plane store's process ended with status {status} before it served "
                "(its error is above)"
            )
        line += chunk
    word, _, baseline = line.decode("ascii", "replace").strip().partition(" ")
    if word != "ready" or not baseline.isdigit():
        raise EpochalError(f"the data-plane store's process said {line[:80]!r}, not ready")
    return int(baseline)


def _end(process: subprocess.Popen[bytes] | Child) -> None:
    """Close the server's input (it ends on its own), then make sure it has ended."""
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def open_store(host: str, timeout: float) -> TCPStore:
    """Rank 0: start a :class:`StoreServer` on ``host`` and return a client of it; the server
    lives as long as that client (or this process)."""
    server = StoreServer.start(host, timeout)
    client = server.connect(timeout)
    weakref.finalize(client, server.close)
    return client


def connect_store(host: str, port: int, timeout: float) -> TCPStore:
    """Any other rank: a client of rank 0's store."""
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def scoped(store: TCPStore, run_id: str, key: str) -> PrefixStore:
    """The view of ``store`` the process group uses: every key under the run's secret."""
    return PrefixStore(f"epochal/{run_id}/{key}" if key else f"epochal/{run_id}", store)
