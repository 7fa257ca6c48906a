"""The connections a process group opened, so that a survivor of a lost rank can close them.

A gloo process group connects to every peer when it is made. When a rank is lost, its peers must
leave the group so that those blocked in a collective with them raise and can meet in a new one.
Destroying the group closes its connections once nothing holds it
(:func:`epochal.worker.regroup.leave`), but a rank blocked in a collective with a peer that is
frozen or cut off never gets there, and gloo has no abort (``ProcessGroup.abort()`` and
``shutdown()`` leave the collective blocked until its timeout, torch 2.13 and 2.14). So
:class:`GroupSockets` notes the TCP connections that appear while the group is made (Linux:
``/proc/self/fd`` and ``/proc/self/net/tcp``), and :meth:`GroupSockets.shut`, called from the
control client's thread too, shuts them down: the blocked collective and every peer's pending
receive then fail at once, "connection closed by peer", as if this rank had died, while this
process and its control connection live on. The
group object itself is abandoned (a few buffers per change of world). Other threads go on while
the group is made (the control client's, which may reconnect to the coordinator meanwhile), so
what it notes is narrowed to what can be gloo's: TCP only (not the unix sockets of an ``ipc://``
control connection), not a connection to an endpoint this process was connected to before (the
coordinator, the store), nor one accepted by a listener it had before: gloo's connections go to
and come from the listeners each rank opens for the new group.

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
_TCP_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")

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


_LISTEN = "0A"
"""The state of a listening socket in the kernel's TCP table."""


def tcp_sockets() -> dict[int, tuple[str, str, str]]:
    """Every TCP socket of this process's network namespace: inode -> (local endpoint, remote
    endpoint, state) as the kernel's table writes them (empty where the tables are not there)."""
    found: dict[int, tuple[str, str, str]] = {}
    for table in _TCP_TABLES:
        try:
            with open(table) as lines:
                next(lines, None)  # the header
                for line in lines:
                    fields = line.split()
                    if len(fields) > 9:
                        found[int(fields[9])] = (fields[1], fields[2], fields[3])
        except OSError:
            continue  # no IPv6, or no /proc
    return found


@dataclass(frozen=True, slots=True)
class GroupSockets:
    """The sockets a process group opened (descriptor -> inode)."""

    sockets: dict[int, int]

    @classmethod
    def opened_by(cls, make: Callable[[], T]) -> tuple[T, GroupSockets]:
        """Run ``make`` (``init_process_group``) and note the TCP connections that appeared
        meanwhile, except those to an endpoint this process was connected to before and those
        accepted by a listener it had before."""
        before = socket_inodes()
        tcp = tcp_sockets()
        mine = [tcp[inode] for inode in before.values() if inode in tcp]
        known = {remote for _, remote, state in mine if state != _LISTEN}
        listening = {local for local, _, state in mine if state == _LISTEN}
        hook = sys.excepthook
        made = make()
        after = socket_inodes()
        _hook_before_group[:] = [hook, sys.excepthook]
        tcp = tcp_sockets()
        new = {}
        for fd, inode in after.items():
            if before.get(fd) == inode or inode not in tcp:
                continue  # there before, or not TCP
            local, remote, state = tcp[inode]
            if state != _LISTEN and remote not in known and local not in listening:
                new[fd] = inode
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
