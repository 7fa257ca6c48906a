"""The forked child's end of the zygote: become the process python would have started, run the
script, end as the interpreter ends.

:func:`become` makes the child what ``python -u SCRIPT ARGS`` would have started, up to running
the script: a session of its own, death with the zygote, the attached descriptors in their
places, its environment, directory and command line. :func:`run` runs the script or module as
``__main__`` (``sys.argv``, ``sys.path[0]``, its exit status, its traceback without these
frames), and :func:`end` ends the process as the interpreter would, less the teardown of the
modules it shares with the zygote.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import fcntl
import gc
import importlib.machinery
import importlib.util
import os
import signal
import socket
import sys
import threading
import types
from collections.abc import Collection
from importlib.machinery import ModuleSpec
from typing import NoReturn

from . import cpython
from .framing import CHANNEL_ENV, Request
from .proctitle import show_environment, show_title

PR_SET_PDEATHSIG = 1
ORPHAN_EXIT_CODE = 70
"""The zygote's exit status (and a child's) when its parent was gone before it armed its death
signal; the same as :data:`epochal.launch.processes.ORPHAN_EXIT_CODE`."""
HIGH_FD = 64
"""Where a child moves the attached descriptors before it puts each in its place."""
HERE = os.path.dirname(os.path.abspath(__file__))
"""The zygote's own directory: its frames are left out of a script's traceback."""


def die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (prctl); leave at once if it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(ORPHAN_EXIT_CODE)


def become(request: Request, fds: list[int], channel: socket.socket | None, zygote: int) -> None:
    """In the forked child: the process ``python -u SCRIPT ARGS`` would have started, up to
    running the script (a session of its own, death with ``zygote``, the attached descriptors
    where the request puts them, its environment, directory and command line)."""
    os.setsid()
    die_with(zygote)
    cpython.disown_finalizers()  # the zygote's objects', not this process's copies of them
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for fd in fds]
    for fd in fds:
        os.close(fd)
    if 0 not in request.fds:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    for fd, target in zip(moved, request.fds, strict=True):
        os.dup2(fd, target, inheritable=target <= 2)
    for fd in moved:
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    if channel is not None:
        os.environ[CHANNEL_ENV] = f"{channel.detach()}:{zygote}"
    if "numpy" in sys.modules:  # a fresh process seeds NumPy's global generator from the OS
        sys.modules["numpy"].random.seed()
    show_title(" ".join(request.argv))
    show_environment(os.environ)


def run(request: Request) -> int:
    """Run the request's script (or module) as ``__main__``; its exit status. An exception it
    raises is printed as the interpreter would print it: the script's frames, not these; so is
    the message of ``sys.exit(MESSAGE)``."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        if request.module is not None:
            sys.argv = ["-m", *request.args]
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            spec = _main_spec(request.module)
            assert spec.loader is not None and spec.origin is not None  # _main_spec's own
            code = spec.loader.get_code(spec.name)  # type: ignore[attr-defined]
            sys.argv[0] = spec.origin
            main.__dict__.update(
                __file__=spec.origin,
                __cached__=spec.cached,
                __loader__=spec.loader,
                __package__=spec.parent,
                __spec__=spec,
            )
        else:
            path = os.path.abspath(request.script or "")
            sys.argv = [request.script or "", *request.args]
            if not request.safe_path:  # `python -P` leaves the script's directory out
                sys.path.insert(0, os.path.dirname(os.path.realpath(path)))  # as python does
            with open(path, "rb") as source:
                code = compile(source.read(), path, "exec")
            main.__dict__.update(
                __file__=path,
                __cached__=None,
                __loader__=importlib.machinery.SourceFileLoader("__main__", path),
            )
        main.__dict__["__builtins__"] = builtins
        exec(code, main.__dict__)
    except SystemExit as exc:
        return exit_status(exc)
    except BaseException as exc:  # the interpreter's own top level
        tb = exc.__traceback__
        while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == HERE:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):  # end by the signal, as the interpreter does
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0


def _main_spec(name: str) -> ModuleSpec:
    """The spec of the module ``python -m name`` runs (a package's ``__main__``), found as
    python finds it (importing its parent packages); SystemExit saying why where there is none,
    in the words ``python -m`` uses."""
    where = f"{sys.executable}: "
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError) as exc:
        raise SystemExit(
            f"{where}Error while finding module specification for {name!r} "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if spec is None:
        raise SystemExit(f"{where}No module named {name}")
    if spec.submodule_search_locations is not None:  # a package: its __main__ is run
        if name == "__main__" or name.endswith(".__main__"):
            raise SystemExit(f"{where}Cannot use package as __main__ module")
        try:
            return _main_spec(f"{name}.__main__")
        except SystemExit as exc:
            raise SystemExit(
                f"{exc.code}; {name!r} is a package and cannot be directly executed"
            ) from None
    if spec.loader is None or spec.origin is None or not hasattr(spec.loader, "get_code"):
        raise SystemExit(f"{where}No code object available for {name}")
    return spec


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
    if not cpython.can_end_by_hand():  # a CPython without the steps: the interpreter ends it
        sys.exit(status)
    with contextlib.suppress(KeyboardInterrupt):
        cpython.wait_for_threads()
    if threading.active_count() > 1:
        # daemon threads still run: only the interpreter stops them before it frees modules
        sys.exit(status)
    cpython.run_exit_functions()
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


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
