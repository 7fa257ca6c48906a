"""The connections a process group opened, so that a survivor of a lost rank can close them.

A gloo process group connects to every peer when it is made. When a rank is lost, its peers must
leave the group so that those blocked in a collective with them raise and can meet in a new one;
but in torch 2.13 destroying a group that DDP has been built over (even with the wrapper and the
model gone and the garbage collected) leaves its connections open until the process exits
(measured: a peer blocked in a broadcast from such a rank raised only when that process ended,
12 s after the group was destroyed), and gloo has no abort. So :class:`GroupSockets` notes the
sockets that appear while the group is made (Linux: ``/proc/self/fd``) and :meth:`GroupSockets.
shut` shuts them down: every peer's pending receive then fails at once, "connection closed by
peer", as if this rank had died, while this process and its control connection live on. The
group object itself is abandoned (a few buffers per change of world).

``init_process_group`` also wraps ``sys.excepthook`` in one that prefixes every line with the
rank (``[rank2]:``), and the next group wraps that again: :meth:`GroupSockets.opened_by` notes the
hook it found, and :func:`restore_excepthook` puts it back when the group is left, so that a
traceback after a regroup carries the rank of the world the process is in, once.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

_FDS = "/proc/self/fd"

_hook_before_group: list[object] = []
"""The ``sys.excepthook`` found when the current group was formed, and the one it installed
(empty: none formed through :meth:`GroupSockets.opened_by`, or left since)."""


def socket_inodes() -> dict[int, int]:
    """This process's open sockets: descriptor -> inode (empty where /proc is not there)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_FDS)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FDS}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found[int(name)] = int(target[len("socket:[") : -1])
    return found


@dataclass(frozen=True, slots=True)
class GroupSockets:
    """The sockets a process group opened (descriptor -> inode)."""

    sockets: dict[int, int]

    @classmethod
    def opened_by(cls, make: Callable[[], T]) -> tuple[T, GroupSockets]:
        """Run ``make`` (``init_process_group``) and note the sockets that appeared meanwhile."""
        before = socket_inodes()
        hook = sys.excepthook
        made = make()
        after = socket_inodes()
        _hook_before_group[:] = [hook, sys.excepthook]
        new = {fd: inode for fd, inode in after.items() if before.get(fd) != inode}
        return made, cls(new)

    def shut(self) -> int:
        """Shut down each connection among these sockets that is still the one noted (its
        descriptor may have been reused); returns how many. Listeners are left alone (gloo ends
        the process when its accept fails), and the descriptors stay open: the group owns them."""
        current = socket_inodes()
        shut = 0
        for fd, inode in self.sockets.items():
            if current.get(fd) != inode:
                continue
            try:
                dup = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # the group's listener: its accept thread must not fail
                dup.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:
                pass  # not connected, or closed by the peer already
            finally:
                dup.close()
        return shut


def restore_excepthook() -> None:
    """Put back the ``sys.excepthook`` that was there before the current group was formed, if the
    group's own is still the one in place (a hook installed since is left alone)."""
    if _hook_before_group and sys.excepthook is _hook_before_group[1]:
        sys.excepthook = _hook_before_group[0]  # type: ignore[assignment]
    _hook_before_group.clear()
