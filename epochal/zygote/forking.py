"""The asking side of a zygote: a launcher's or a worker's, which has it fork processes.

:func:`connect` reaches a shared zygote (``epochal preload SOCKET``) and checks that it may fork
for this process; :func:`channel_from` finds the channel a forked worker has to the zygote it
was forked from; :func:`popen` has the zygote fork a process of its own, as ``subprocess.Popen``
would start one (rank 0's data-plane store server), and :class:`Child` stands where a ``Popen``
would; :func:`ask` sends one request (:mod:`epochal.zygote.framing`) and reads the child's pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from .framing import CHANNEL_ENV, encode, network_namespace, peer


def channel_from(environ: Mapping[str, str] | None = None) -> socket.socket | None:
    """This process's channel to the zygote it was forked from, None where it was not (or the
    descriptor ``EPOCHAL_ZYGOTE`` names is not a channel to that process: a process the worker
    started inherits the variable, not the channel; or this process has entered another network
    namespace since)."""
    environ = os.environ if environ is None else environ
    fd_text, _, pid_text = environ.get(CHANNEL_ENV, "").partition(":")
    if not (fd_text.isdigit() and pid_text.isdigit()):
        return None
    try:
        channel = socket.socket(fileno=os.dup(int(fd_text)))
    except OSError:
        return None
    try:
        if (
            channel.family == socket.AF_UNIX
            and peer(channel)[0] == int(pid_text)
            and os.readlink(f"/proc/{pid_text}/ns/net") == network_namespace()
        ):  # what that process forks listens and connects in its network, not this one's
            return channel
    except OSError:
        pass
    channel.close()
    return None


_asking = threading.Lock()
"""One reader of the channels at a time: an answer read for another child is kept for it."""
_exits: dict[int, int] = {}
"""Exit statuses read while waiting for something else, by pid."""
_POLL = 0.1
"""Seconds between two looks at :data:`_exits` while waiting on a channel."""


def _next(channel: socket.socket, timeout: float | None) -> dict[str, Any] | None:
    """The next message on ``channel`` within ``timeout`` (None: none came; ``{}``: the channel
    closed); an exit is kept in :data:`_exits` as well."""
    if not select.select([channel], [], [], timeout)[0]:
        return None
    try:
        data = channel.recv(65536)
    except OSError:
        data = b""
    if not data:
        return {}
    message: dict[str, Any] = json.loads(data)
    if "exited" in message:
        _exits[int(message["exited"])] = int(message["status"])
    return message


class Child:
    """A process the zygote forked for this one: ``pid``, ``stdin``/``stdout`` (where asked
    for), ``wait``, ``poll``, ``kill``, as a ``subprocess.Popen``."""

    def __init__(
        self,
        channel: socket.socket,
        pid: int,
        stdin: IO[bytes] | None,
        stdout: IO[bytes] | None,
    ):
        self._channel = channel
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._read(0.0)

    def wait(self, timeout: float | None = None) -> int:
        status = self._read(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return status

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def _read(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            with _asking:
                if self.pid in _exits:
                    self.returncode = _exits.pop(self.pid)
                    break
                left = _POLL if deadline is None else min(_POLL, deadline - time.monotonic())
                if _next(self._channel, max(left, 0.0)) == {}:
                    self.returncode = -signal.SIGKILL  # the zygote is gone, its children too
                    break
                if self.pid in _exits:
                    continue
            if deadline is not None and time.monotonic() >= deadline:
                return None
        with contextlib.suppress(OSError):
            self._channel.close()
        return self.returncode


def popen(
    channel: socket.socket,
    script: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    stdin: bool = False,
    stdout: bool = False,
    pass_fds: Sequence[int] = (),
) -> Child:
    """Have the zygote behind ``channel`` (from :func:`channel_from`; the child closes it) run
    ``python -u -P script args`` (the script's directory not on the path): with pipes for
    ``stdin``/``stdout`` where asked, this process's standard error, and ``pass_fds`` at their
    own numbers."""
    ends: list[int] = []
    attached: list[int] = []
    targets: list[int] = []
    mine: list[IO[bytes]] = []
    try:
        if stdin:
            r, w = os.pipe()
            ends.append(r)
            attached.append(r)
            targets.append(0)
            mine.append(os.fdopen(w, "wb", buffering=0))
        if stdout:
            r, w = os.pipe()
            ends.append(w)
            attached.append(w)
            targets.append(1)
            mine.append(os.fdopen(r, "rb", buffering=0))
        attached += [2, *pass_fds]
        targets += [2, *pass_fds]
        request = {
            "id": 0,
            "script": script,
            "module": None,
            "args": list(args),
            "env": dict(env),
            "cwd": os.getcwd(),
            "argv": [sys.executable, "-u", "-P", script, *args],
            "fds": targets,
            "safe_path": True,
        }
        pid = ask(channel, request, attached)
    except BaseException:
        for pipe in mine:
            pipe.close()
        channel.close()
        raise
    finally:
        for fd in ends:
            os.close(fd)
    pipes = iter(mine)
    return Child(
        channel,
        pid,
        next(pipes) if stdin else None,
        next(pipes) if stdout else None,
    )


def ask(channel: socket.socket, request: dict[str, Any], fds: Sequence[int]) -> int:
    """Send ``request`` with ``fds`` attached (the descriptor numbers they become in the child
    are the request's ``fds``) and wait for the forked child's pid; OSError naming what failed
    when the zygote could not fork it or has gone."""
    with _asking:
        socket.send_fds(channel, [encode(request)], list(fds))
        answer: dict[str, Any] | None = None
        while not answer or "exited" in answer:
            answer = _next(channel, None)
            if answer == {}:
                break
    if not answer or "pid" not in answer:
        what = request.get("script") or request.get("module")
        error = (answer or {}).get("error", "it has ended")
        raise OSError(f"the preloaded process could not start {what}: {error}")
    return int(answer["pid"])


def connect(
    path: str, timeout: float | None = None, *, any_network: bool = False
) -> tuple[socket.socket, dict[str, Any]]:
    """A channel to the shared zygote listening at ``path`` (``epochal preload``), and what it said
    once it had imported its modules (``executable``, ``modules``, ``env``); OSError when none
    listens there, it runs as another user, in another network namespace (unless
    ``any_network``: for processes meant to run in that one's network) or another interpreter (so
    would its children), or it said nothing within ``timeout`` seconds."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        channel.connect(path)
        _, uid = peer(channel)
        if uid != os.getuid():
            raise OSError(f"it is served by user {uid}, not by this user ({os.getuid()})")
        hello = _next(channel, timeout)
        if not hello or "ready" not in hello:
            raise OSError(f"the process there did not say it was ready within {timeout} s")
        if not any_network and hello.get("netns") != network_namespace():
            raise OSError("it runs in another network namespace")
        if hello.get("executable") != sys.executable:
            raise OSError(f"it runs {hello.get('executable')}, not {sys.executable}")
    except BaseException:
        channel.close()
        raise
    return channel, hello
