"""Scripts written for torchrun, run unchanged by ``epochal run``.

Such a script calls ``torch.distributed.init_process_group()`` itself, reading ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` from its environment, and keeps its own loop: it
never calls :func:`epochal.train` or :func:`epochal.join`, so the coordinator never hears from it.
The launcher gives every worker those variables (a free loopback port for ``MASTER_PORT``) and
watches that port: ``init_process_group`` makes rank 0 listen there (torch's TCPStore server), so a
listener on it, before any worker said hello, means the script set up its own process group. The
coordinator then stands down with one line saying what needs ``epochal.train``/``epochal.join``,
and the launcher does what torchrun does for such a script: the run is finished when every worker
exits 0; the first that exits otherwise stops the others (SIGTERM, then SIGKILL after
``ABORT_EXIT_TIMEOUT``).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from epochal.launch.processes import kill_group

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


def listening(port: int) -> bool:
    """Whether a TCP socket in this network namespace listens on ``port`` (Linux; read from
    ``/proc/net``, so nothing connects to it)."""
    for table in _TABLES:
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if (
                len(fields) > 3
                and fields[3] == _LISTEN
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                return True
    return False


async def made_its_own_group(
    port: int, possible: Callable[[], bool], interval: float = 0.2
) -> bool:
    """Whether something came to listen on ``port`` (rank 0's process group store) while
    ``possible()`` held (no worker has said hello yet); checked every ``interval`` seconds."""
    while possible():
        if listening(port):
            return True
        await asyncio.sleep(interval)
    return False


async def wait_plain(
    procs: list[asyncio.subprocess.Process],
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
