"""What Linux and its C library say of this process's connections and memory, for the guard.

The connection guard (:mod:`.connections`) needs three things no Python or ZeroMQ API gives: how
many bytes libzmq has read off one TCP connection, this process's resident memory, and a way to
hand freed heap back to the system. They are Linux's and glibc's, and all of that reliance is
here, with ``tests/coordinator/test_kernel.py`` failing by the name of the thing that changed:

- :func:`bytes_read`: ``tcpi_bytes_received`` of ``struct tcp_info`` (``getsockopt(TCP_INFO)``,
  Linux 4.1 and later: the bytes the connection received in order) less the bytes still unread
  in its receive queue (``ioctl(SIOCINQ)``): what libzmq's I/O thread read;
- :func:`resident_bytes`: the second field of ``/proc/self/statm``, read from a descriptor kept
  open, so that a look costs one ``pread``;
- :func:`give_back_memory`: glibc's ``malloc_trim(0)``, which returns the free pages of every
  arena to the system. Without it glibc keeps the heap a flood of held frames grew. Measured on
  ``epochal coordinator``: 1,000 connections each holding all but a byte of a 64 KiB frame, then
  closed, left 88 MiB resident, 1 MiB with a trim after they closed; 2,000 such connections
  reopened as soon as closed for 15 s left 154 MiB, 2 MiB with the trims. A trim took 4 ms.
  Making libzmq's frames ``mmap``-ed instead (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``) gave back
  only part of it (31 of 97 MiB stayed on a bare ROUTER), so only the trim is kept.

Elsewhere (another kernel, another C library) each returns None or False: the guard then holds
what libzmq's own limits hold, no more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import termios

TCP_INFO = getattr(socket, "TCP_INFO", 11)
"""``getsockopt``'s option for ``struct tcp_info`` (linux/tcp.h)."""

BYTES_RECEIVED_AT = 128
"""Offset of ``tcpi_bytes_received`` (a u64) in ``struct tcp_info``: 8 one-byte fields, 24 u32s,
then the u64s ``tcpi_pacing_rate``, ``tcpi_max_pacing_rate``, ``tcpi_bytes_acked``."""

TCP_INFO_BYTES = 232
"""Room for ``struct tcp_info`` as recent kernels fill it; a kernel that fills less than
``BYTES_RECEIVED_AT + 8`` (before 4.1) has no count to give."""

SIOCINQ = termios.FIONREAD
"""``ioctl`` that says how many received bytes are still unread (linux/sockios.h: FIONREAD)."""


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_getsockopt = None if _LIBC is None else getattr(_LIBC, "getsockopt", None)
_ioctl = None if _LIBC is None else getattr(_LIBC, "ioctl", None)
_malloc_trim = None if _LIBC is None else getattr(_LIBC, "malloc_trim", None)
if _getsockopt is not None:
    _getsockopt.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint32),
    ]
    _getsockopt.restype = ctypes.c_int
if _ioctl is not None:
    _ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.POINTER(ctypes.c_int)]
    _ioctl.restype = ctypes.c_int
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int

_info = ctypes.create_string_buffer(TCP_INFO_BYTES)
_info_len = ctypes.c_uint32()
_unread = ctypes.c_int()
_COUNT = struct.Struct("=Q")


def bytes_read(fd: int) -> int | None:
    """The bytes read so far off the TCP connection on ``fd`` (by whoever reads it: libzmq);
    None when ``fd`` is not a TCP socket, is closed, or the kernel does not count them."""
    if _getsockopt is None or _ioctl is None:
        return None
    _info_len.value = TCP_INFO_BYTES
    if _getsockopt(fd, socket.IPPROTO_TCP, TCP_INFO, _info, ctypes.byref(_info_len)) != 0:
        return None
    if _info_len.value < BYTES_RECEIVED_AT + _COUNT.size:
        return None
    if _ioctl(fd, SIOCINQ, ctypes.byref(_unread)) != 0:
        return None
    received: int = _COUNT.unpack_from(_info, BYTES_RECEIVED_AT)[0]
    return received - _unread.value


class Resident:
    """This process's resident memory, read from ``/proc/self/statm`` through a descriptor kept
    open (one ``pread`` a look); :meth:`close` it. Without ``/proc``, :meth:`bytes` is None."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def bytes(self) -> int | None:
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) * self._page
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def resident_bytes() -> int | None:
    """This process's resident memory now (one look; :class:`Resident` to look often)."""
    resident = Resident()
    try:
        return resident.bytes()
    finally:
        resident.close()


def give_back_memory() -> bool:
    """Hand the C library's free heap pages back to the system (glibc's ``malloc_trim(0)``);
    False where there is no such call."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True
