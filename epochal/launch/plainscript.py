"""Scripts written for torchrun, run unchanged by ``epochal run``.

Such a script calls ``torch.distributed.init_process_group()`` itself, reading ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` from its environment, and keeps its own loop: it
never calls :func:`epochal.train` or :func:`epochal.join`, so the coordinator never hears from it.
The launcher gives every worker those variables (a free loopback port for ``MASTER_PORT``) and
watches that port: ``init_process_group`` makes rank 0 listen there (torch's TCPStore server), so a
worker listening on it, before any worker said hello, means the script set up its own process
group. Only a socket one of the workers holds counts: the port was free when it was chosen, and
any other process (another run's store, say) may have bound it since. The
coordinator then stands down with one line saying what needs ``epochal.train``/``epochal.join``,
and the launcher does what torchrun does for such a script: the run is finished when every worker
exits 0; the first that exits otherwise stops the others (SIGTERM, then SIGKILL after
its workers' ``abort_grace`` and a margin: ``launcher.abort_exit_timeout``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from epochal.launch.processes import Child, kill_group

PLAIN_LINE = (
    "the script made its own process group (a torchrun script): epochal starts its workers, "
    "gives them torchrun's variables and stops them all if one fails; epochs decided for every "
    "rank, checkpoints and resume, schedules, early stopping, status and elastic runs need "
    "epochal.train() or epochal.join()"
)
"""What the coordinator says when it stands down for such a script."""

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the kernel's choice), for ``MASTER_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listening(port: int, pids: Iterable[int] | None = None) -> bool:
    """Whether a TCP socket in this network namespace listens on ``port`` (Linux; read from
    ``/proc/net``, so nothing connects to it); with ``pids``, only a socket one of those
    processes holds counts (the tables, which list every socket of the namespace and are long
    on a busy machine, are read only once one of them holds a socket: a worker still importing
    torch holds none)."""
    held: set[str] | None = None
    if pids is not None:
        held = set().union(*(_sockets(pid) for pid in pids))
        if not held:
            return False
    inodes: set[str] = set()
    for table in _TABLES:
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if (
                len(fields) > 9
                and fields[3] == _LISTEN
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(f"socket:[{fields[9]}]")
    if held is None:
        return bool(inodes)
    return bool(inodes & held)


def _sockets(pid: int) -> set[str]:
    """The sockets process ``pid`` holds, as its descriptors' links name them
    (``socket:[INODE]``); none for a process gone or not ours to read."""
    held: set[str] = set()
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return held
    for fd in descriptors:
        try:
            held.add(os.readlink(fd))
        except OSError:  # closed meanwhile
            continue
    return held


GLANCE = 0.02
"""Seconds between two looks at the workers' descriptors while no worker has said hello. A
script's process group may live a fraction of a second (forked from a process that imported
torch, a short script is up and done in 0.3 s): a look every 0.2 s missed it."""


async def made_its_own_group(
    port: int,
    possible: Callable[[], bool],
    pids: Iterable[int],
    interval: float = 0.2,
    glance: float = GLANCE,
) -> bool:
    """Whether one of ``pids`` (the workers) came to listen on ``port`` (rank 0's process group
    store) while ``possible()`` held (no worker has said hello yet). The workers' descriptors
    are looked at every ``glance`` seconds; the namespace's socket tables (long on a busy
    machine) are read when a worker holds a socket not seen before, and every ``interval``
    seconds while one holds any. The looking runs on a thread of its own, so that the event loop
    it is awaited on, which also runs the coordinator, cannot hold it up: a group may live only a
    fraction of a second, and a look that comes late misses it."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(_look, port, possible, list(pids), interval, glance, stop)
    finally:
        stop.set()  # cancelled: the thread ends at its next glance


def _look(
    port: int,
    possible: Callable[[], bool],
    pids: list[int],
    interval: float,
    glance: float,
    stop: threading.Event,
) -> bool:
    """:func:`made_its_own_group`'s looking, until ``stop`` is set."""
    seen: set[str] = set()
    last = -interval
    while possible() and not stop.is_set():
        held = set().union(*(_sockets(pid) for pid in pids))
        now = time.monotonic()
        if held and (held - seen or now - last >= interval):
            if listening(port, pids):
                return True
            seen |= held
            last = now
        stop.wait(glance)
    return False


async def wait_plain(
    procs: Sequence[Child],
    watchers: list[asyncio.Task[int]],
    grace: float,
) -> int | None:
    """Wait for every worker of a plain run: the first that exits non-zero stops the others
    (SIGTERM to each process group, SIGKILL ``grace`` seconds later). Returns that worker's
    index, None when every worker exited 0."""
    pending = set(watchers)
    first: int | None = None
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        failed = [watchers.index(task) for task in done if task.result() != 0]
        if first is None and failed:
            first = min(failed)
            for proc in procs:
                if proc.returncode is None:
                    kill_group(proc.pid, signal.SIGTERM)
            if pending:
                _, pending = await asyncio.wait(pending, timeout=grace)
                for proc in procs:
                    if proc.returncode is None:
                        kill_group(proc.pid, signal.SIGKILL)
    return first
