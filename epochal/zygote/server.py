"""The zygote's loop: import the preloaded modules once, then answer requests to fork.

:func:`main` imports the modules, says ``ready`` and serves (:class:`Server`) either the one
launcher's channel (the zygote of one ``epochal run``: it ends when that channel closes) or a
listening socket (``epochal preload SOCKET``, one zygote shared by the launches of its user):
each connection, from a process of this user only, is a launcher's channel, greeted with what
this process imported and where, and a launch's children are killed when its connection closes.
A child asked with ``"channel": true`` gets a channel of its own, over which it may ask the same
(rank 0's store server).

Nothing a peer sends ends this process, whose death ends every worker it forked: a request it
cannot read (:func:`epochal.zygote.framing.parse`) is answered with the error, and said once a
connection on standard error. Nor does it fork where a fork is unsafe (:func:`fork_hazard`):
with a second thread (a fork copies only the caller, not the locks the others held) or CUDA
initialized (which a forked child cannot use). It checks before each fork, since a preloaded
module may start a thread at any time; the launch is told why, and starts its workers as fresh
interpreters.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
from typing import Any, NoReturn

from .child import become, die_with, end, run
from .framing import (
    IMPORT_ENV,
    MAX_FDS,
    MESSAGE_BYTES,
    BadRequest,
    Request,
    encode,
    network_namespace,
    parse,
    peer,
    request_id,
)
from .proctitle import show_title

Job = tuple[Request, list[int], socket.socket | None]
"""What a forked child is to do: its request, the descriptors attached, its own channel."""

PRELOAD_HINT = "a module it imported did so: EPOCHAL_PRELOAD names what it imports"


def fork_hazard(*, threads: int, tasks: int, cuda: bool) -> str:
    """Why forking a process with ``threads`` Python threads, ``tasks`` threads of the kernel's
    (``/proc/self/task``: also those no Python code started; 0 where unknown) and CUDA
    initialized or not is unsafe; '' where it is safe."""
    if max(threads, tasks) > 1:
        return (
            f"the preloaded process runs {max(threads, tasks)} threads, and a worker forked "
            f"from it would inherit what locks the others held ({PRELOAD_HINT})"
        )
    if cuda:
        return (
            "CUDA is initialized in the preloaded process, and a worker forked from it could "
            f"not use CUDA ({PRELOAD_HINT})"
        )
    return ""


def fork_hazard_now() -> str:
    """:func:`fork_hazard` of this process as it is."""
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = 0
    torch = sys.modules.get("torch")
    try:
        cuda = bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # a torch without cuda, or half-imported: nothing was initialized
        cuda = False
    return fork_hazard(threads=threading.active_count(), tasks=tasks, cuda=cuda)


def _listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


class Server:
    """Requests from the launchers and from their workers, answered; exits reported."""

    def __init__(self, first: socket.socket, hello: dict[str, Any]):
        self.listener = first if _listening(first) else None
        self.launcher = None if self.listener is not None else first
        self.hello = hello
        self.channels: dict[int, socket.socket] = {}
        self.launchers: set[socket.socket] = set()
        if self.launcher is not None:
            self.channels[first.fileno()] = first
            self.launchers.add(first)
        self.owners: dict[int, socket.socket] = {}  # pid -> the channel that asked for it
        self.said: set[int] = set()  # the channels whose bad request was said on stderr
        self.refused = False  # a refusal to fork was said (shared zygote)
        self.deaf: set[socket.socket] = set()  # askers that read none of their answers

    def _send(self, channel: socket.socket, message: dict[str, Any]) -> None:
        """Answer ``channel``; an asker gone does not stop the others, nor does one that reads
        nothing of what it is sent (its answers filled its socket's queue): that one is
        dropped, as if it had closed. The one launcher of this zygote is waited for."""
        try:
            if channel is self.launcher:
                channel.sendall(encode(message))
            else:
                channel.send(encode(message), socket.MSG_DONTWAIT)
        except BlockingIOError:
            self.deaf.add(channel)
        except OSError:
            pass

    def serve(self) -> Job | None:
        """Answer requests until the launcher closes its channel (None then). In a forked child,
        return its job."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler: the wake-up fd is written
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C for the run
        listening = [] if self.listener is None else [self.listener.fileno()]
        while True:
            ready, _, _ = select.select([*self.channels, *listening, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 4096)
                self._reap()
            if self.listener is not None and self.listener.fileno() in ready:
                self._accept(self.listener)
            for fd in ready:
                channel = self.channels.get(fd)
                if channel is None:
                    continue
                try:
                    data, fds, flags, _ = socket.recv_fds(channel, MESSAGE_BYTES, MAX_FDS)
                except OSError:
                    data, fds, flags = b"", [], 0
                if not data:
                    for fd_ in fds:
                        os.close(fd_)
                    if channel is self.launcher:
                        return None
                    self._drop(channel)
                    continue
                child = self._answer(channel, data, fds, flags)
                if child is not None:
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    return child
            for channel in self.deaf:
                if channel.fileno() in self.channels:
                    self._drop(channel)
            self.deaf.clear()

    def _answer(
        self, channel: socket.socket, data: bytes, fds: list[int], flags: int
    ) -> Job | None:
        """Fork for one request, or answer why not; in the forked child, its job."""
        try:
            request = parse(data, len(fds), flags)
            error = fork_hazard_now()
            if not error:
                return self._fork(channel, request, fds)
            self._refuse(error)
        except BadRequest as exc:
            self._say(channel, f"a request it cannot serve: {exc}")
            error = f"a request the preloaded process cannot serve: {exc}"
        except OSError as exc:  # no fork now: no memory, too many processes
            error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a mistake of ours; this process's end would kill every child
            self._say(channel, f"a request it failed on: {type(exc).__name__}: {exc}")
            error = f"{type(exc).__name__}: {exc}"
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._send(channel, {"failed": request_id(data), "error": error})
        return None

    def _say(self, channel: socket.socket, what: str) -> None:
        """Say on standard error, once a channel, that a peer asked what cannot be done."""
        if channel.fileno() in self.said:
            return
        self.said.add(channel.fileno())
        try:
            pid = peer(channel)[0]
        except OSError:
            pid = 0
        sys.stderr.write(
            f"epochal: the preloaded process {os.getpid()} was sent {what} (by process {pid}); "
            "it answered with the error (said once a connection)\n"
        )

    def _refuse(self, hazard: str) -> None:
        """A shared zygote says once why it forks no more; a launch's own leaves it to the
        launcher, which says it in its one line."""
        if self.listener is not None and not self.refused:
            self.refused = True
            sys.stderr.write(f"epochal: not forking: {hazard}\n")

    def _accept(self, listener: socket.socket) -> None:
        """A launch connects: served when it runs as this process's user, closed otherwise."""
        try:
            channel, _ = listener.accept()
        except OSError:
            return
        if peer(channel)[1] != os.getuid():
            channel.close()
            return
        self.channels[channel.fileno()] = channel
        self.launchers.add(channel)
        self._send(channel, self.hello)

    def _fork(self, channel: socket.socket, request: Request, fds: list[int]) -> Job | None:
        own: socket.socket | None = None
        theirs: socket.socket | None = None
        try:
            if request.channel:
                own, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
        except OSError:
            for end_ in (own, theirs):
                if end_ is not None:
                    end_.close()
            raise
        if pid == 0:
            try:
                for other in self.channels.values():
                    other.close()
                if self.listener is not None:
                    self.listener.close()
                if own is not None:
                    own.close()
            except BaseException:  # never back into the loop: that is the zygote's
                os._exit(1)
            return request, fds, theirs
        for fd in fds:
            os.close(fd)
        fds.clear()  # closed: nothing closes them again
        if theirs is not None and own is not None:
            theirs.close()
            self.channels[own.fileno()] = own
        self.owners[pid] = channel
        self._send(channel, {"started": request.id, "pid": pid})
        return None

    def _drop(self, channel: socket.socket) -> None:
        """A channel closed: a launcher's children are killed with it (their sessions), as they
        would die with a zygote of their own; a worker's (its store server) end by themselves."""
        del self.channels[channel.fileno()]
        self.said.discard(channel.fileno())
        channel.close()
        launcher = channel in self.launchers
        self.launchers.discard(channel)
        for pid in [pid for pid, owner in self.owners.items() if owner is channel]:
            del self.owners[pid]
            if launcher:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.owners.pop(pid, None)
            if owner is not None:
                self._send(owner, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def main(argv: list[str]) -> NoReturn:
    """``zygote FD PARENT ROOM MODULE...``: import the MODULEs, then serve FD (a launcher's
    channel, or a listening socket) until the launcher closes it (or, listening, until PARENT
    dies); in each forked child, run its request and end."""
    fd, parent, modules = int(argv[1]), int(argv[2]), argv[4:]  # argv[3]: the room
    die_with(parent)
    first = socket.socket(fileno=fd)
    listening = _listening(first)
    who = f"epochal preload {first.getsockname()}" if listening else f"epochal run {parent}"
    show_title(f"{who}: importing {', '.join(modules) or 'nothing'} once, forking")
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # said in one line; the launcher then starts workers afresh
            sys.stderr.write(
                f"epochal: cannot import {name!r} once for every worker: "
                f"{type(exc).__name__}: {exc} (EPOCHAL_PRELOAD names what is imported; "
                "none imports nothing)\n"
            )
            sys.exit(1)
    gc.collect()
    gc.freeze()  # what the children share stays shared: the collector never writes to it
    hello = {
        "ready": True,
        "executable": sys.executable,
        "modules": modules,
        "env": {name: os.environ.get(name) for name in IMPORT_ENV},
        "netns": network_namespace(),
    }
    if not listening:
        try:
            first.sendall(json.dumps(hello).encode())
        except OSError:  # the launcher stopped (or gave up on this process) meanwhile
            sys.exit(0)
    me = os.getpid()
    job = Server(first, hello).serve()
    if job is None:
        sys.exit(0)
    request, fds, channel = job
    shared = set(sys.modules)
    try:
        become(request, fds, channel, me)
    except Exception as exc:  # what python says of a directory it cannot enter, say
        sys.stderr.write(f"epochal: cannot start {' '.join(request.argv)}: {exc}\n")
        os._exit(1)
    end(run(request), shared)
