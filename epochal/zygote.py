"""The preloaded parent of a local run's processes: one process imports torch, the others fork.

Every worker of ``epochal run`` used to start a fresh interpreter and import torch on its own:
about 2.4 s of CPU each (``import torch`` 1.3 s; ``torch._dynamo``, which torch's optimizers import
the first time one is built, 1.0-1.2 s), N times over on one machine, and rank 0's data-plane
store server 1.5 s more, which the other ranks wait for. This process imports them once; each
worker is a ``fork`` of it that then runs the user's script as ``python -u SCRIPT ARGS`` would
(``__main__``, ``sys.argv``, ``sys.path[0]``, its environment, its exit status) and ends as the
interpreter ends, less the teardown of the modules it shares with this process (:func:`end`);
rank 0 asks it for its store server the same way. It is Python's own ``multiprocessing``
forkserver with a preload, reduced to what a launcher needs: the standard streams and
descriptors the asker attaches, a session of its own, death with its parent, and the exit status
reported back.

:class:`epochal.launch.preload.Preloaded` starts this file as a script (``python -u -P
zygote.py FD PARENT ROOM MODULE...``), by path: it imports nothing of epochal, so that nothing
epochal reads at import time is fixed here for every worker. FD is one end of a
``SOCK_SEQPACKET`` pair (the launcher holds the other); PARENT is the launcher's pid; ROOM is
:data:`ARGV_ROOM` spaces, room for the children's command lines (:func:`_show`); the MODULEs are
imported before the process says ``ready``. Over FD, the launcher asks (JSON, descriptors
attached)::

    {"id": 1, "script": PATH | null, "module": NAME | null, "args": [...], "env": {...},
     "cwd": DIR, "argv": ["python", "-u", PATH, ...], "fds": [1, 2], "channel": true}

(``fds``: the descriptor number each attached one becomes in the child; standard input is
``/dev/null`` unless one becomes 0), and this process answers ``{"started": 1, "pid": PID}`` (or
``{"failed": 1, "error": ...}``), later ``{"exited": PID, "status": N}`` (N as
``Popen.returncode`` gives it: negative for a signal). A child asked with ``"channel": true`` gets
a channel of its own to this process, named in ``EPOCHAL_ZYGOTE`` (``FD:PID``), over which it may
ask the same (:func:`popen`: rank 0's store server). When the launcher's channel closes, this
process ends, and every child with it (their death signal).

FD may instead be a listening Unix socket (``epochal preload SOCKET``,
:func:`epochal.launch.preload.serve`): each connection, from a process of this user only, is a
launcher's channel as above, greeted with what this process imported and where (``{"ready":
true, "executable", "modules", "env", "netns"}``) so that the launch can tell whether its
workers may be forked here (:func:`connect`); a launcher's children are killed when its
connection closes, and this process serves until its parent ends.

Fork safety: nothing here starts a thread, touches CUDA or runs an operator before it forks (torch
starts its thread pools and CUDA on first use, in each worker); the interpreter reseeds
``random`` in each child, and this module reseeds NumPy's global generator, so no two workers
share a random stream they did not ask to share.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import fcntl
import gc
import importlib
import importlib.machinery
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import IO, Any, NoReturn

CHANNEL_ENV = "EPOCHAL_ZYGOTE"
"""``FD:PID``: a forked worker's channel to the process it was forked from (PID)."""

ROOM_ENV = "EPOCHAL_ZYGOTE_ROOM"
"""A variable of :data:`ENV_ROOM` spaces in this process's own environment: the room each child
rewrites with its environment (:func:`_show`). The launcher sets it; nothing reads it."""
ENV_ROOM = 16384
"""Bytes of room for a child's environment beyond this process's own."""
ARGV_ROOM = 4096
"""Bytes of room for a child's command line: an argument of as many spaces the launcher passes."""

PR_SET_PDEATHSIG = 1
ORPHAN_EXIT_CODE = 70
"""This process's exit status (and a child's) when its parent was gone before it armed its death
signal; the same as :data:`epochal.launch.processes.ORPHAN_EXIT_CODE`."""
MESSAGE_BYTES = 1 << 20
"""The largest request read (a worker's environment, its arguments)."""
MAX_FDS = 8
"""The most descriptors one request attaches."""
HIGH_FD = 64
"""Where a child moves the attached descriptors before it puts each in its place."""


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (prctl); leave at once if it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(ORPHAN_EXIT_CODE)


def _send(channel: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # an asker gone does not stop the others
        channel.sendall(json.dumps(message).encode())


class _Server:
    """The zygote's loop: requests from its launchers and from their workers, exits reported.

    ``first`` is either the one launcher's channel (the zygote of one ``epochal run``: it ends
    when that channel closes) or a listening socket (one zygote shared by the launches of its
    user that connect to it, ``epochal preload``): each connection is a launcher's, whose
    children are killed when it closes."""

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

    def serve(self) -> tuple[dict[str, Any], list[int], socket.socket | None] | None:
        """Answer requests until the launcher closes its channel (None then). In a forked child,
        return its request, the descriptors that came with it, and its own channel."""
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
                    data, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, MAX_FDS)
                except OSError:
                    data, fds = b"", []
                if not data:
                    if channel is self.launcher:
                        return None
                    self._drop(channel)
                    continue
                child = self._fork(channel, data, fds)
                if child is not None:
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    return child

    def _accept(self, listener: socket.socket) -> None:
        """A launch connects: served when it runs as this process's user, closed otherwise."""
        try:
            channel, _ = listener.accept()
        except OSError:
            return
        if _peer(channel)[1] != os.getuid():
            channel.close()
            return
        self.channels[channel.fileno()] = channel
        self.launchers.add(channel)
        _send(channel, self.hello)

    def _fork(
        self, channel: socket.socket, data: bytes, fds: list[int]
    ) -> tuple[dict[str, Any], list[int], socket.socket | None] | None:
        own: socket.socket | None = None
        theirs: socket.socket | None = None
        try:
            request = json.loads(data)
            if request.get("channel"):
                own, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
        except (ValueError, OSError) as exc:
            for fd in fds:
                os.close(fd)
            for end in (own, theirs):
                if end is not None:
                    end.close()
            _send(channel, {"failed": _id(data), "error": f"{type(exc).__name__}: {exc}"})
            return None
        if pid == 0:
            for other in self.channels.values():
                other.close()
            if self.listener is not None:
                self.listener.close()
            if own is not None:
                own.close()
            return request, fds, theirs
        for fd in fds:
            os.close(fd)
        if theirs is not None and own is not None:
            theirs.close()
            self.channels[own.fileno()] = own
        self.owners[pid] = channel
        _send(channel, {"started": request["id"], "pid": pid})
        return None

    def _drop(self, channel: socket.socket) -> None:
        """A channel closed: a launcher's children are killed with it (their sessions), as they
        would die with a zygote of their own; a worker's (its store server) end by themselves."""
        del self.channels[channel.fileno()]
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
                _send(owner, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})


def _listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


def _peer(channel: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket."""
    creds = channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def network_namespace() -> str:
    """This process's network namespace (``net:[INODE]``; '' where it cannot be read): a child
    forked here listens and connects in it, whatever the asker's is."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


IMPORT_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOGLEVEL")
"""Variables read as the preloaded modules are imported (torch sizes its thread pools from
``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``; ``torch.distributed.checkpoint`` sets the level of
torch's elastic loggers from ``LOGLEVEL``): a launch whose values differ does not use a shared
zygote imported with others."""


def _id(data: bytes) -> Any:
    try:
        return json.loads(data).get("id")
    except (ValueError, AttributeError):
        return None


def become(
    request: dict[str, Any], fds: list[int], channel: socket.socket | None, zygote: int
) -> None:
    """In the forked child: the process ``python -u SCRIPT ARGS`` would have started, up to
    running the script (a session of its own, death with ``zygote``, the attached descriptors
    where the request puts them, its environment, directory and arguments)."""
    os.setsid()
    _die_with(zygote)
    # weakref.finalize callbacks registered here belong to this process's objects, not the
    # child's copies of them (multiprocessing clears its own in a forked child): torch registers
    # one per operator library, each of which would unregister its operators at the child's exit
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        finalizer.atexit = False
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    targets = list(request.get("fds", []))
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for fd in fds]
    for fd in fds:
        os.close(fd)
    if 0 not in targets:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    for fd, target in zip(moved, targets, strict=False):
        os.dup2(fd, target, inheritable=target <= 2)
    for fd in moved:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if channel is not None:
        os.environ[CHANNEL_ENV] = f"{channel.detach()}:{zygote}"
    if "numpy" in sys.modules:  # a fresh process seeds NumPy's global generator from the OS
        sys.modules["numpy"].random.seed()
    _show(request["argv"], os.environ)


def _show(argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Make ``/proc/self/cmdline`` say ``argv`` and ``/proc/self/environ`` say ``env`` (None: as it
    is), as they would after an ``exec``: what ``ps``, ``pgrep -f`` and anyone reading those files
    see. The kernel reads both from the memory the process started with (its arguments and its
    environment, on its stack), so each is rewritten in place, NUL-padded to its length, as
    setproctitle(3) does: a command line longer than that is cut, an environment longer than
    that is left as the zygote's. This process's own ``environ`` no longer points there (the
    request's environment was put with ``putenv``), so nothing it reads changes."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        # proc(5): fields 48-51 are arg_start, arg_end, env_start, env_end (3 is the first here)
        arg_start, arg_end, env_start, env_end = (int(field) for field in fields[45:49])
    except (OSError, ValueError):
        return
    _write(arg_start, arg_end, b"".join(os.fsencode(word) + b"\0" for word in argv), cut=True)
    if env is not None:
        block = b"".join(os.fsencode(f"{key}={value}") + b"\0" for key, value in env.items())
        _write(env_start, env_end, block, cut=False)


def _write(start: int, end: int, data: bytes, *, cut: bool) -> None:
    room = end - start
    if room <= 0 or (len(data) > room and not cut):
        return
    data = data[: room - 1] + b"\0" if len(data) > room else data
    ctypes.memmove(start, data + bytes(room - len(data)), room)


def run(request: dict[str, Any]) -> int:
    """Run the request's script (or module) as ``__main__``; its exit status. An exception it
    raises is printed as the interpreter would print it: the script's frames, not these; so is
    the message of ``sys.exit(MESSAGE)``."""
    script, module, args = request["script"], request["module"], request["args"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        if module is not None:
            sys.argv = ["-m", *args]  # runpy puts the module's path first, as `python -m` does
            sys.path.insert(0, os.getcwd())
            import runpy

            # what `python -m` itself calls: the module runs in the __main__ just made
            runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]
        else:
            path = os.path.abspath(script)
            sys.argv = [script, *args]
            if not request.get("safe_path"):  # `python -P` leaves the script's directory out
                sys.path.insert(0, os.path.dirname(os.path.realpath(path)))  # as python does
            with open(path, "rb") as source:
                code = compile(source.read(), path, "exec")
            main.__dict__.update(
                __file__=path,
                __cached__=None,
                __builtins__=builtins,
                __loader__=importlib.machinery.SourceFileLoader("__main__", path),
            )
            exec(code, main.__dict__)
    except SystemExit as exc:
        return exit_status(exc)
    except BaseException as exc:  # the interpreter's own top level
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, _runpy_file()):
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):  # end by the signal, as the interpreter does
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0


def exit_status(exc: SystemExit) -> int:
    """The status the interpreter exits with for ``exc``: 0 for no code, an int as it is (its low
    byte), anything else printed to standard error and 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(exc.code, file=sys.stderr)
    return 1


def end(status: int, shared: Collection[str]) -> NoReturn:
    """End this forked child as the interpreter ends, less the teardown of the modules it shares
    with the process it was forked from (``shared``: their names).

    As ``Py_FinalizeEx`` does: wait for the threads that are not daemons, run the ``atexit``
    callbacks, free ``__main__`` and every module imported since the fork (their objects'
    finalizers run: files they hold are flushed and closed, temporary files removed), collect
    the garbage, flush the standard streams (status 120 if standard output cannot be). The
    shared modules are left as they are: their objects are this process's copies of the
    parent's pages, and tearing them down, as the interpreter would, wrote to about 40,000 of
    them (160 MB copied) and took 0.25-0.6 s of CPU in every worker, launcher and store server,
    for nothing another process could see. ``multiprocessing`` ends its forked children with
    ``os._exit`` for the same reason, without the rest."""
    with contextlib.suppress(KeyboardInterrupt):
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    if threading.active_count() > 1:
        # daemon threads still run: only the interpreter stops them before it frees modules
        sys.exit(status)
    atexit._run_exitfuncs()
    _release([name for name in sys.modules if name not in shared])
    for stream in (sys.stdout, sys.stderr):  # as the interpreter flushes them: a failure is 120
        if stream is None or getattr(stream, "closed", True):
            continue
        try:
            stream.flush()
        except Exception as exc:
            status = 120
            if stream is sys.stdout:
                with contextlib.suppress(Exception):
                    sys.stderr.write(
                        f"Exception ignored in: {stream!r}\n{type(exc).__name__}: {exc}\n"
                    )
    os._exit(status)


def _release(names: list[str]) -> None:
    """Free the modules ``names`` and ``__main__`` as the interpreter's teardown frees modules:
    out of ``sys.modules``, the last imported first, each one's names set to None (those starting
    with ``_`` first), then the garbage collected. (Collected first, a file object and its buffer
    would be finalized in no particular order, and what the file had not yet written lost.)"""
    modules: list[object] = [sys.modules.pop(name) for name in reversed(names)]
    modules.append(sys.modules.pop("__main__", None))
    for module in modules:
        if not isinstance(module, types.ModuleType):
            continue
        namespace = vars(module)
        for first in (True, False):
            for key in list(namespace):
                if key != "__builtins__" and key.startswith("_") == first:
                    namespace[key] = None
    del modules
    gc.collect()


def _runpy_file() -> str:
    runpy = sys.modules.get("runpy")
    return getattr(runpy, "__file__", "") or ""


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()


def main(argv: list[str]) -> NoReturn:
    fd, parent, modules = int(argv[1]), int(argv[2]), argv[4:]  # argv[3]: the room
    _die_with(parent)
    first = socket.socket(fileno=fd)
    listening = _listening(first)
    who = f"epochal preload {first.getsockname()}" if listening else f"epochal run {parent}"
    _show([f"{who}: importing {', '.join(modules) or 'nothing'} once, forking"])
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
    job = _Server(first, hello).serve()
    if job is None:
        sys.exit(0)
    request, fds, channel = job
    shared = set(sys.modules)
    become(request, fds, channel, me)
    end(run(request), shared)


# The asking side, in a worker forked by the zygote: a process of its own, as subprocess would.


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
            and _peer(channel)[0] == int(pid_text)
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
        socket.send_fds(channel, [json.dumps(request).encode()], list(fds))
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
        _, uid = _peer(channel)
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


if __name__ == "__main__":
    main(sys.argv)
