"""What every process epochal starts gets: death with its parent, and a group to kill."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import Protocol

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal a child gets when its parent dies (Linux)."""

ORPHAN_EXIT_CODE = 70
"""A worker's exit status when its launcher died while starting it (before exec)."""


def die_with_parent(parent: int | None = None) -> None:
    """In the child, before exec: SIGKILL it when the launcher dies, however the launcher dies.

    The death signal is armed only for a parent alive at the ``prctl``; a launcher that died
    between the fork and here has already been replaced by a reaper, so the child compares its
    parent with ``parent`` (the launcher's pid) and leaves at once when they differ.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the process-group kill at exit still applies
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(ORPHAN_EXIT_CODE)


def kill_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (a child started in a session of its
    own), the child's own children included; a group already gone is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Child(Protocol):
    """A worker process the launcher started: an ``asyncio.subprocess.Process``, or one forked by
    its preloaded process (:class:`epochal.launch.preload.Forked`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...
