"""What ``ps`` and ``/proc`` show of the zygote and of each child it forks.

A forked child has the zygote's command line and environment in ``/proc/PID/cmdline`` and
``/proc/PID/environ`` until it says otherwise: it says the command line a fresh interpreter would
have had (what ``ps``, ``pgrep -f`` and ``top`` show), through the ``setproctitle`` package, and
its own environment (what tools that find a process by a variable read), by hand, since no
interface sets it. The kernel reads both from the memory the process was started with, so
their length is fixed then: the zygote is started with :data:`ARGV_ROOM` spaces as an argument
and :data:`ENV_ROOM` spaces in a variable, room for the children's.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

import setproctitle

ROOM_ENV = "EPOCHAL_ZYGOTE_ROOM"
"""A variable of :data:`ENV_ROOM` spaces in the zygote's own environment: the room each child
rewrites with its environment (:func:`show_environment`). The launcher sets it; nothing reads
it."""
ENV_ROOM = 16384
"""Bytes of room for a child's environment beyond the zygote's own."""
ARGV_ROOM = 4096
"""Bytes of room for a child's command line: an argument of as many spaces the launcher passes."""

NO_ENV = "SPT_NOENV"
"""Set as setproctitle first looks at this process: it then leaves the environment's memory
alone (it would move the environment and write the title over it), for
:func:`show_environment`, and for ``/proc/PID/environ`` to go on saying the zygote's own."""


def show_title(title: str) -> None:
    """Have ``ps`` and ``/proc/self/cmdline`` say ``title`` (cut to the room there is), leaving
    the process's name (``/proc/self/comm``: ``python``, as an ``exec`` of the interpreter
    names it) as it is. In the zygote it is called before anything changes the environment:
    setproctitle finds the command line's memory from the environment's."""
    had = os.environ.get(NO_ENV)
    os.environ[NO_ENV] = "1"
    try:
        name = setproctitle.getthreadtitle()  # the main thread's name is the process's
        setproctitle.setproctitle(title)
        if name:
            setproctitle.setthreadtitle(name)
    finally:
        if had is None:
            os.environ.pop(NO_ENV, None)
        else:
            os.environ[NO_ENV] = had


def show_environment(env: Mapping[str, str]) -> None:
    """Make ``/proc/self/environ`` say ``env``, as it would after an ``exec``: rewritten in
    place, NUL-padded to its length (an environment longer than that is left as the zygote's).
    Only once ``os.environ`` no longer points there (the child's environment was put with
    ``putenv``): nothing this process reads changes."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        # proc(5): fields 50 and 51 are env_start and env_end (3 is the first here)
        start, end = (int(field) for field in fields[47:49])
    except (OSError, ValueError):
        return
    block = b"".join(os.fsencode(f"{key}={value}") + b"\0" for key, value in env.items())
    room = end - start
    if 0 < len(block) <= room:
        ctypes.memmove(start, block + bytes(room - len(block)), room)
