"""``python innetns.py NAME SCRIPT ARGS`` (or ``NAME -m MODULE ARGS``): run a Python script in the
test host NAME, as ``ip netns exec NAME python SCRIPT ARGS`` does, in a process forked from the
session's preloaded one (:mod:`tests.forked`) rather than a fresh interpreter.

It enters what ``ip netns exec`` enters: the network namespace ``/var/run/netns/NAME``, and a
mount namespace of its own in which ``/sys`` is that network's (so ``/sys/class/net`` lists the
host's devices). Then it runs the script as ``__main__``, with its arguments and its directory
first on the path (``-m``: the working directory), as python would.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 1 << 19
MNT_DETACH = 2


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter(name: str) -> None:
    """Enter host ``name``'s network namespace, and remount ``/sys`` for it, as ip(8) does."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns {name}")
    finally:
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "make / a slave mount")
    libc.umount2(b"/sys", MNT_DETACH)  # as ip(8): what was there goes, whatever it was
    _check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount /sys")


def main() -> None:
    name, *command = sys.argv[1:]
    enter(name)
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        sys.path[0] = os.path.dirname(os.path.realpath(command[0]))
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main()
