"""Rank 0's data-plane store server, run in a process of its own whose memory is capped.

:class:`epochal.worker.dataplane.store.StoreServer` starts this file as a script (``python -P
storeserver.py FD HOST PORT TIMEOUT OWNER``), by path rather than as ``-m
epochal.worker.dataplane.storeserver``: the package's ``__init__`` would import the whole worker API
for a process that needs only torch's ``TCPStore``. So it imports nothing of epochal; the parent
imports it as a module for :func:`budget` and :func:`cap`. A worker that ``epochal run`` forked
from its preloaded process has that process fork this one too (:func:`epochal.zygote.popen`):
torch is imported already, and the other ranks do not wait for a second import.

The process imports torch, caps its own data (``RLIMIT_DATA``: heap and every private writable
mapping) at what it then holds (BASELINE) plus :func:`budget`, serves a ``TCPStore`` on the
listening socket FD (bound by the parent), prints ``ready BASELINE``, and serves until its
standard input closes or rank 0's process (OWNER) ends, however it ends. Whatever anyone
who reaches the port sends, the store's memory cannot grow past that cap: an allocation past it
fails, torch's server closes the connection that asked for it, and the training process is not
touched. See :mod:`epochal.worker.dataplane.store` for why a cap, not a sweep of foreign keys.
"""

from __future__ import annotations

import functools
import os
import resource
import select
import signal
import sys
from datetime import timedelta
from typing import Any

BASE_BYTES = 64 * 1024 * 1024
"""Data the store may hold beyond its start-up, whatever the world size: the process group's keys
and the server's buffers for a run of up to about a thousand ranks fit in a fraction of it."""

RANK_BYTES = 16 * 1024
"""Data allowed per rank once the world size is known (a connection and its keys: about 2 KiB)."""

PAIR_BYTES = 16
"""Data allowed per rank squared: gloo's full mesh has each rank publish about 8 bytes per peer
(measured: 183, 199 and 231 bytes a rank at 2, 4 and 8 ranks), 800 MB at 10,000 ranks."""


PARENT_CHECK_INTERVAL = 1.0
"""Seconds between two looks at whether the process that started this one still lives."""


def budget(world_size: int | None) -> int:
    """Bytes of data the store may hold beyond its start-up for ``world_size`` ranks (None: not
    known yet): 64 MiB + 16 KiB per rank + 16 bytes per rank squared."""
    n = world_size or 0
    return BASE_BYTES + RANK_BYTES * n + PAIR_BYTES * n * n


def data_bytes(pid: int | str = "self") -> int:
    """The data (``VmData``: what ``RLIMIT_DATA`` limits) process ``pid`` holds, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/status has no VmData line")


def cap(pid: int, baseline: int, world_size: int | None) -> int:
    """Set process ``pid``'s (0: this one) data limit to ``baseline`` + :func:`budget`, within its
    hard limit; returns the limit set."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_DATA)
    limit = baseline + budget(world_size)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.prlimit(pid, resource.RLIMIT_DATA, (limit, hard))
    return limit


def serve(fd: int, host: str, port: int, timeout: float, store: Any = None) -> Any:
    """A TCPStore server on the listening socket ``fd``; ``host`` is where its own client reaches
    it. ``store``: the TCPStore class (torch's unless given)."""
    if store is None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        store = TCPStore
    server = functools.partial(
        store,
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
        master_listen_fd=fd,
    )
    try:
        return server()
    except NotImplementedError:
        # torch before 2.8: its default (libuv) store cannot take a listening socket; the older
        # backend can, and serves a run's rendezvous as well
        return server(use_libuv=False)


def main(argv: list[str]) -> int:
    fd, host, port, timeout = int(argv[1]), argv[2], int(argv[3]), float(argv[4])
    owner = int(argv[5]) if len(argv) > 5 else os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; we end with it
    import torch.distributed  # noqa: F401  (imported before the baseline is taken)

    baseline = data_bytes()
    cap(0, baseline, None)
    store = serve(fd, host, port, timeout)
    print(f"ready {baseline}", flush=True)
    _serve_until_closed(owner)
    del store
    return 0


def _serve_until_closed(owner: int) -> None:
    """Return once standard input closes or process ``owner`` (rank 0) ends: a process forked from
    it (a data loader's worker) may hold the input open a while longer, and this process's parent
    may be another (the run's preloaded process, :mod:`epochal.zygote`)."""
    try:
        ended = os.pidfd_open(owner)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):  # no pidfd (Linux before 5.3): look every so often
        while _alive(owner):
            if select.select([0], [], [], PARENT_CHECK_INTERVAL)[0] and not os.read(0, 4096):
                return
        return
    try:
        while True:
            ready = select.select([0, ended], [], [])[0]
            if ended in ready or not os.read(0, 4096):
                return
    finally:
        os.close(ended)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv))
