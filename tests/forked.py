"""The suite's preloaded process: torch imported once per test process, its processes forked.

Most of the suite's CPU went into importing torch: every ``epochal run`` started a process that
imported it for its workers, and every worker or coordinator a test starts by hand (the
standalone, security and fault tests) imported it again. :func:`start_server` starts one
``epochal preload`` for the whole session (:mod:`epochal.launch.preload`), named in
``EPOCHAL_PRELOAD_SOCKET`` so that every launch the tests start forks its workers there, and
:class:`ForkedProcess` is what a test uses of :class:`subprocess.Popen` for a process that server
forks: ``python -u SCRIPT ARGS`` or ``python -u -m MODULE ARGS``, with the standard output and
error on one pipe read as text. ``tests/launch/test_zygote.py`` holds that such a process is the
one python itself would have started (its ``__main__``, arguments, path, environment, directory,
session, signals and exit status), so the tests see what a user's process does.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from epochal import zygote
from epochal.environment import PRELOAD_SOCKET_ENV
from epochal.launch.preload import CONNECT_TIMEOUT, parse_command, preload_modules, serve

EXIT_REPORT = 1.0
"""Seconds allowed, beyond a deadline, for the preloaded process to report an exit it has seen."""


SESSION_PRELOAD = (
    "matplotlib.pyplot",
    "epochal.cli.parser",
    "epochal.launch.launcher",
    "epochal.worker",
    "torch.distributed.optim",
)
"""Imported by the session's process beside what ``epochal run`` asks for. Every launch the tests
start is forked from it too, and draws its learning curve at the end: importing matplotlib took
0.4 s of a launcher's 1.0 s of CPU, and epochal's command line 0.25 s more. Every worker imports
``epochal.worker`` (0.13 s after torch), and each rank of a sharded mode ZeRO's
``torch.distributed.optim`` (0.2-0.5 s: it compiles TorchScript). None of these reads the
environment as it is imported (checked: only pyzmq's and msgpack's own ``PYZMQ_BACKEND`` and
``MSGPACK_PUREPYTHON``), so a process forked with another environment is the one python would
have started. (``epochal run``'s own preloaded process imports nothing of epochal, by design:
what a user's modules read as they are imported is not for it to fix.)"""


def start_server(directory: Path, env: Mapping[str, str]) -> tuple[str, subprocess.Popen[bytes]]:
    """Start the session's preloaded process listening in ``directory`` (a private one), which
    imports in ``env``; its socket's path and the process."""
    path = str(directory / "preload.sock")
    return path, serve(path, (*preload_modules(env), *SESSION_PRELOAD), env)


def forkable(args: Sequence[str]) -> bool:
    """Whether ``python -u ARGS`` is forked from the session's process: a script or ``-m
    MODULE`` (no other interpreter option); not ``epochal coordinator``, which imports no torch:
    forked, its memory would count torch's pages, and the tests bound what it uses."""
    if list(args[:3]) == ["-m", "epochal", "coordinator"]:
        return False
    try:
        parse_command([sys.executable, *args])
    except ValueError:
        return False
    return True


class ForkedProcess:
    """``python -u *args`` forked by the preloaded process at ``server`` (default:
    ``env[EPOCHAL_PRELOAD_SOCKET]``): ``pid`` (its own session), ``args``, ``stdout`` (text, with
    its standard error; None where they go to the file ``stdout`` given), ``returncode``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate`` and ``kill``, as
    :class:`subprocess.Popen` has them. It runs in the server's network, whichever that is (a test
    host's, :mod:`tests.multihost.netns`). The process is killed if this one closes its channel
    before it ended (the test process died, say). ``channel_of_its_own=False``: the process gets
    no channel of its own to the server (``EPOCHAL_ZYGOTE``), as one python started has none."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | Path,
        server: str | None = None,
        stdout: IO[Any] | None = None,
        channel_of_its_own: bool = True,
    ):
        self.args = [sys.executable, "-u", *args]
        script, module, rest = parse_command(self.args)
        # in the server's network, whichever it is (a test host's: tests.multihost)
        channel, _ = zygote.connect(
            server or env[PRELOAD_SOCKET_ENV], CONNECT_TIMEOUT, any_network=True
        )
        read_end, write_end = os.pipe() if stdout is None else (-1, stdout.fileno())
        request: dict[str, Any] = {
            "id": 1,
            "script": script,
            "module": module,
            "args": rest,
            "env": dict(env),
            "cwd": str(cwd),
            "argv": self.args,
            "fds": [1, 2],
            # a rank 0 has its store server forked too; without a channel, a process asks the
            # server EPOCHAL_PRELOAD_SOCKET names, as one started by hand does
            "channel": channel_of_its_own,
        }
        try:
            self.pid = zygote.ask(channel, request, [write_end, write_end])
        except BaseException:
            if stdout is None:
                os.close(read_end)
            channel.close()
            raise
        finally:
            if stdout is None:
                os.close(write_end)
        self._child = zygote.Child(channel, self.pid, None, None)
        self.stdout: IO[str] | None = None
        if stdout is None:
            self.stdout = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stdin = self.stderr = None
        self.returncode: int | None = None
        self._read: list[bytes] = []

    def poll(self) -> int | None:
        self.returncode = self._child.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self._child.wait(timeout)
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[str, None]:
        """Read the output to its end and wait, as Popen does (within ``timeout`` seconds, or
        TimeoutExpired; what was read is kept for the next call)."""
        if self.stdout is None or self.stdout.closed:
            out = ""
        elif timeout is None:
            out = b"".join(self._read).decode("utf-8", "replace") + self.stdout.read()
            self.stdout.close()
        else:
            deadline = time.monotonic() + timeout
            fd = self.stdout.fileno()
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                data = os.read(fd, 65536)
                if not data:
                    break
                self._read.append(data)
            out = b"".join(self._read).decode("utf-8", "replace")
            self.stdout.close()
            # its exit is reported through the preloaded process a moment after its output ends
            timeout = max(0.0, deadline - time.monotonic()) + EXIT_REPORT
        self.wait(timeout)
        return out.replace("\r\n", "\n").replace("\r", "\n"), None

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if not getattr(self, "stdout", None) or self.stdout.closed:
            return
        self.stdout.close()
