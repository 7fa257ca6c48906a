"""``python hostpreload.py NAME SOCKET MODULE...``: the preloaded process of test host NAME.

Forked from the session's preloaded process (:mod:`tests.forked`), so it has imported what that
one imported (the MODULEs, named again for its greeting), it enters what ``ip netns exec NAME``
enters: the network namespace ``/var/run/netns/NAME``, and a mount namespace of its own in which
``/sys`` is that network's (so ``/sys/class/net`` lists the host's devices). Then it listens on
SOCKET and serves as ``epochal preload`` serves (:func:`epochal.zygote.main`): every Python
program the tests start on the host is forked from it, in the host already. So is what such a
program asks of its zygote, rank 0's data-plane store server, which must listen in the host's
network: one forked in the root namespace and moved into the host afterwards could not ask for
it, and started a store server as a fresh interpreter that imported torch (1.5 s of CPU).
"""

from __future__ import annotations

import ctypes
import os
import sys

from epochal import zygote
from epochal.launch.preload import listen

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
    name, path, *modules = sys.argv[1:]
    enter(name)
    listener = listen(path)  # this user's alone, as epochal preload's
    # the room argument is unused: this process's command line has the session process's room
    zygote.main(["zygote", str(listener.detach()), str(os.getppid()), "", *modules])


if __name__ == "__main__":
    main()
