"""The launcher's side of :mod:`epochal.zygote`: start it, fork workers, see them end.

``epochal run`` starts one zygote per launch (it outlives restarts and starts elastic
replacements too) and asks it for each worker; a :class:`Forked` worker stands where an
``asyncio.subprocess.Process`` would (``pid``, ``returncode``, ``wait()``, ``stdout``). Where the
zygote cannot start (the modules fail to import, say), the launcher says so once and starts each
worker as a fresh interpreter, as it does with ``EPOCHAL_PRELOAD=none``.

``epochal preload SOCKET`` (:func:`serve`) starts one zygote shared by the launches of its user:
a launch whose ``EPOCHAL_PRELOAD_SOCKET`` names it connects (:meth:`Preloaded.connect`) rather
than start its own, unless that one cannot serve it (:func:`_unfit`), which is said in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epochal import zygote
from epochal.environment import PRELOAD_ENV, PRELOAD_SOCKET_ENV
from epochal.errors import ConfigError, EpochalError
from epochal.launch.processes import die_with_parent
from epochal.zygote import ARGV_ROOM, ENV_ROOM, IMPORT_ENV, ROOM_ENV
from epochal.zygote import SCRIPT as ZYGOTE_SCRIPT

DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint")
"""What the zygote imports: torch, its process groups, ``torch._dynamo``, which torch's
optimizers import the first time one is built (1.0-1.2 s of CPU a process, measured), and
``torch.distributed.checkpoint``, which every worker imports for its first checkpoint (0.05-0.1 s
a process)."""

OFF = ("none", "0", "")


def worker_threads(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``OMP_NUM_THREADS=1`` unless it sets its own: what epochal's local workers
    get (N workers on one machine must not each start a thread per core), and so what the process
    they are forked from imports torch with (torch reads it then)."""
    return {"OMP_NUM_THREADS": "1", **env}


def preload_modules(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The modules ``EPOCHAL_PRELOAD`` names (comma-separated; ``none``: fork nothing, start each
    worker afresh), else :data:`DEFAULT_PRELOAD`."""
    environ = os.environ if environ is None else environ
    raw = environ.get(PRELOAD_ENV)
    if raw is None:
        return DEFAULT_PRELOAD
    if raw.strip().lower() in OFF:
        return ()
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    bad = [name for name in names if not all(part.isidentifier() for part in name.split("."))]
    if bad:
        raise ConfigError(
            f"{PRELOAD_ENV}={raw!r}: {', '.join(map(repr, bad))} is not a module name; give "
            "module names separated by commas (torch,torch._dynamo), or none"
        )
    return names


class Forked:
    """A worker forked by the zygote: what the launcher uses of an asyncio subprocess."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def _exited(self, status: int) -> None:
        if self.returncode is None:
            self.returncode = status
            self._ended.set_result(status)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)


class Preloaded:
    """One zygote: :meth:`start`, :meth:`spawn` as often as needed, :meth:`close` at the end."""

    def __init__(self, process: subprocess.Popen[bytes] | None, channel: socket.socket):
        self._process = process
        self._channel = channel
        self._ids = itertools.count(1)
        self._asked: dict[int, asyncio.Future[int]] = {}
        self._forked: dict[int, Forked] = {}
        self._early: dict[int, int] = {}  # statuses of pids reported before their start was seen
        self._ready: asyncio.Future[None] | None = None
        self._gone = False

    @classmethod
    def start(cls, modules: Sequence[str], env: Mapping[str, str]) -> Preloaded:
        """Start a zygote that imports ``modules`` in environment ``env``; :meth:`ready` says
        when it serves."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            process = _zygote(theirs, modules, env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls._serving(process, ours)

    @classmethod
    async def connect(cls, path: str, modules: Sequence[str], env: Mapping[str, str]) -> Preloaded:
        """The shared zygote listening at ``path`` (:func:`serve`), ready; OSError naming why
        this launch cannot use it: none listens there, another user's, one in another network
        namespace or interpreter (:func:`epochal.zygote.connect`), or one that imported other
        modules, or with other values of :data:`IMPORT_ENV`."""
        channel, hello = await asyncio.to_thread(zygote.connect, path, CONNECT_TIMEOUT)
        unfit = _unfit(hello, modules, env)
        if unfit:
            channel.close()
            raise OSError(unfit)
        self = cls._serving(None, channel)
        assert self._ready is not None
        self._ready.set_result(None)
        return self

    @classmethod
    def _serving(cls, process: subprocess.Popen[bytes] | None, channel: socket.socket) -> Preloaded:
        channel.setblocking(False)
        self = cls(process, channel)
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        loop.add_reader(channel.fileno(), self._readable)
        return self

    async def ready(self) -> bool:
        """Whether the zygote serves (False: it ended before it served, its error on stderr, or
        it has ended since)."""
        assert self._ready is not None
        with contextlib.suppress(EpochalError):
            await asyncio.shield(self._ready)
            return not self._gone
        return False

    async def spawn(self, command: Sequence[str], env: Mapping[str, str]) -> Forked:
        """Fork a worker that runs ``command`` (``[python, -u, SCRIPT, ARGS...]`` or ``[python,
        -u, -m, MODULE, ARGS...]``, as :func:`epochal.launch.launcher.script_command` makes) in
        ``env``, its output to a pipe read by the returned worker's ``stdout``; the worker may
        ask the zygote for processes of its own (:func:`epochal.zygote.popen`)."""
        script, module, args = parse_command(command)
        loop = asyncio.get_running_loop()
        request_id = next(self._ids)
        asked: asyncio.Future[int] = loop.create_future()
        self._asked[request_id] = asked
        read_end, write_end = os.pipe()
        try:
            request = {
                "id": request_id,
                "script": script,
                "module": module,
                "args": list(args),
                "env": dict(env),
                "cwd": os.getcwd(),
                "argv": list(command),
                "fds": [1, 2],
                "channel": True,
            }
            await self._send(json.dumps(request).encode(), [write_end, write_end])
        except BaseException:
            os.close(read_end)
            self._asked.pop(request_id, None)
            raise
        finally:
            os.close(write_end)
        try:
            pid = await asked
        except BaseException:  # not forked: the pipe is closed here, no transport left open
            os.close(read_end)
            raise
        # read once forked (what it writes meanwhile waits in the pipe): a transport made
        # before would be left, on a refused fork, to close at a later turn of a loop that may
        # end first, its pipe then found open by the garbage collector
        reader = asyncio.StreamReader(limit=2**20)
        pipe = os.fdopen(read_end, "rb", buffering=0)
        try:
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        except BaseException:
            pipe.close()
            raise
        forked = Forked(pid, reader)
        self._forked[pid] = forked
        if pid in self._early:
            forked._exited(self._early.pop(pid))
        return forked

    async def _send(self, data: bytes, fds: list[int]) -> None:
        if self._gone:
            raise EpochalError("the launcher's preloaded process has ended")
        while True:
            try:
                socket.send_fds(self._channel, [data], fds)
                return
            except BlockingIOError:
                await asyncio.sleep(0.01)
            except OSError as exc:
                raise EpochalError(f"the launcher's preloaded process has ended ({exc})") from exc

    def _readable(self) -> None:
        while True:
            try:
                data = self._channel.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._ended()
                return
            self._dispatch(json.loads(data))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "ready" in message and self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        elif "started" in message:
            asked = self._asked.pop(message["started"], None)
            if asked is not None and not asked.done():
                asked.set_result(message["pid"])
        elif "failed" in message:
            asked = self._asked.pop(message["failed"], None)
            if asked is not None and not asked.done():
                asked.set_exception(EpochalError(f"could not fork a worker: {message['error']}"))
        elif "exited" in message:
            pid, status = message["exited"], message["status"]
            forked = self._forked.pop(pid, None)
            if forked is None:
                self._early[pid] = status
            else:
                forked._exited(status)

    def _ended(self) -> None:
        """The zygote is gone: so are its workers (their death signal killed them)."""
        if self._gone:
            return
        self._gone = True
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._channel.fileno())
        gone = EpochalError("the launcher's preloaded process ended")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(gone)
            self._ready.exception()  # retrieved: ready() says False
        for asked in self._asked.values():
            if not asked.done():
                asked.set_exception(gone)
        for forked in self._forked.values():
            forked._exited(-9)
        self._forked.clear()

    def close(self) -> None:
        """End the zygote (idempotent); a worker still running ends with it."""
        serving = self._ready is not None and self._ready.done() and not self._ready.exception()
        if not self._gone:
            self._ended()
        with contextlib.suppress(OSError):
            self._channel.close()  # a shared zygote kills what it forked for this launch
        if self._process is None:
            return
        if not serving:  # still importing: nothing of it is worth waiting for
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class Preload:
    """The zygote of one launch: started when its first workers are (so a launch that stops
    before any worker starts, on a bad option say, imports nothing), kept for the restarts and
    the replacements, closed at the end. Without one (``EPOCHAL_PRELOAD=none``, a command that is
    not a Python script or module, a zygote that failed) the launcher starts each worker
    afresh."""

    def __init__(self, modules: Sequence[str], command: Sequence[str], env: Mapping[str, str]):
        self._modules = tuple(modules)
        self._env = dict(env)
        self._zygote: Preloaded | None = None
        self._off = not self._modules
        try:
            parse_command(command)
        except ValueError:
            self._off = True

    async def get(
        self, failed: Callable[[], None], said: Callable[[str], None] = lambda _: None
    ) -> Preloaded | None:
        """The zygote, serving (on the first call: the shared one ``EPOCHAL_PRELOAD_SOCKET``
        names, else one started for this launch; ``said`` is told why a shared one is not
        used); None without one. ``failed`` is called once, when the zygote ended before it
        served (its error is on stderr) or has ended since (killed, say: its workers with
        it)."""
        if self._off:
            return None
        if self._zygote is None:
            path = self._env.get(PRELOAD_SOCKET_ENV)
            if path:
                try:
                    self._zygote = await Preloaded.connect(path, self._modules, self._env)
                except OSError as exc:
                    said(
                        f"{PRELOAD_SOCKET_ENV}={path}: {exc.strerror or exc}; this launch imports "
                        f"{', '.join(self._modules)} in a process of its own"
                    )
        if self._zygote is None:
            self._zygote = Preloaded.start(self._modules, self._env)
        if await self._zygote.ready():
            return self._zygote
        self._off = True
        failed()
        return None

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()


CONNECT_TIMEOUT = 300.0
"""Seconds a launch waits for a shared zygote that is still importing its modules."""


def _unfit(hello: Mapping[str, Any], modules: Sequence[str], env: Mapping[str, str]) -> str:
    """Why a shared zygote that said ``hello`` cannot fork this launch's workers ('' if it can)."""
    missing = [name for name in modules if name not in hello.get("modules", [])]
    if missing:
        return f"it has not imported {', '.join(missing)}"
    theirs = hello.get("env", {})
    differ = [name for name in IMPORT_ENV if theirs.get(name) != env.get(name)]
    if differ:
        return "it imported them with other values of " + ", ".join(
            f"{name} ({theirs.get(name)!r}, not {env.get(name)!r})" for name in differ
        )
    return ""


def _zygote(
    end: socket.socket, modules: Sequence[str], env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """Start the zygote on ``end`` (a channel, or a listening socket), dying with this process."""
    return subprocess.Popen(
        [
            sys.executable,
            "-u",
            "-P",  # never import from the launcher's directory
            ZYGOTE_SCRIPT,
            str(end.fileno()),
            str(os.getpid()),
            " " * ARGV_ROOM,  # room for each worker's command line (zygote.proctitle)
            *modules,
        ],
        stdin=subprocess.DEVNULL,
        pass_fds=(end.fileno(),),
        env={**env, ROOM_ENV: " " * ENV_ROOM},  # and for its environment
        start_new_session=True,
        preexec_fn=functools.partial(die_with_parent, os.getpid()),
    )


def serve(path: str, modules: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start a zygote that imports ``modules`` in ``env`` once and forks the workers of every
    launch of this user that connects to the Unix socket it listens on at ``path`` (each
    launch's ``EPOCHAL_PRELOAD_SOCKET``). The socket is made readable by this user alone and
    the zygote serves no other user (it checks each peer); it ends with this process, and its
    children with it. ConfigError where ``path`` cannot be listened on."""
    try:
        listener = listen(path)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {path}: {exc.strerror or exc} (name a path in a directory "
            "of yours where no socket is yet)"
        ) from exc
    try:
        return _zygote(listener, modules, env)
    finally:
        listener.close()


def listen(path: str) -> socket.socket:
    """A ``SOCK_SEQPACKET`` Unix socket listening at ``path``, made readable by this user alone:
    what a shared zygote serves launches on."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        mask = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(mask)
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    return listener


def add_command(subparsers: Any) -> None:
    """Add ``epochal preload SOCKET`` to the command line's ``subparsers``."""
    p = subparsers.add_parser(
        "preload",
        help="import torch once and fork the workers of every local launch that names SOCKET",
        description="Import torch (EPOCHAL_PRELOAD's modules) once and serve the launches of "
        f"this user that set {PRELOAD_SOCKET_ENV}=SOCKET: each `epochal run` then has this "
        "process fork its workers rather than start one that imports torch for it alone "
        "(useful where many short runs start on one machine: a sweep, a notebook, a test "
        "suite). Runs until interrupted; the workers it forked end with it, and their "
        "launches then start their workers afresh.",
    )
    p.add_argument("socket", metavar="SOCKET", help="path of the Unix socket to listen on")
    p.set_defaults(handler=run_serve)


def run_serve(args: Any) -> int:
    """``epochal preload SOCKET``: serve until interrupted or terminated (0), or the preloaded
    process ends (1)."""
    modules = preload_modules()
    if not modules:
        raise ConfigError(f"{PRELOAD_ENV}=none: there is nothing to preload")
    path = os.path.abspath(args.socket)
    process = serve(path, modules, worker_threads(os.environ))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: the socket is removed
    print(
        f"epochal: importing {', '.join(modules)} once; launches with "
        f"{PRELOAD_SOCKET_ENV}={path} fork their workers from it (Ctrl-C ends it)",
        file=sys.stderr,
        flush=True,
    )
    try:
        status = process.wait()
    except KeyboardInterrupt:
        process.kill()
        process.wait()
        status = 0
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return 0 if status == 0 else 1


def parse_command(command: Sequence[str]) -> tuple[str | None, str | None, list[str]]:
    """``(script, module, args)`` of a ``python [-u] SCRIPT|-m MODULE ARGS...`` command line;
    ValueError for any other shape (the launcher then starts that worker afresh)."""
    rest = list(command[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return None, rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return rest[0], None, rest[1:]
    raise ValueError(f"not a script or module command line: {list(command)!r}")
