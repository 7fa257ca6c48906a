"""Raising this process's open-files limit: every process of a run needs one descriptor per peer.

The coordinator holds one connection per worker; a worker's gloo process group connects to every
other rank, and rank 0 serves the data-plane store. Both raise their soft ``RLIMIT_NOFILE`` to
the hard limit at start (:func:`raise_nofile_limit`), which any process may do. Standard library
only: the coordinator and the workers both call it (the coordinator's other limits are in
:mod:`epochal.coordinator.serve.oslimits`).
"""

from __future__ import annotations

import resource
from pathlib import Path

NOFILE_FALLBACK = 10240
"""The soft limit tried where the hard limit is unlimited and the system names no maximum (macOS
refuses an unlimited soft limit but takes OPEN_MAX, 10,240)."""

NR_OPEN_PATH = Path("/proc/sys/fs/nr_open")


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def raise_nofile_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return (old, new) soft.

    A hard limit of "unlimited" is not a value the soft limit may take: the system's maximum
    (Linux: ``fs.nr_open``) is used instead, or :data:`NOFILE_FALLBACK`. Where the system refuses
    the new value, the limit stays as it was and (old, old) is returned. Never lowers the limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = read_int(NR_OPEN_PATH) or NOFILE_FALLBACK
    if soft != resource.RLIM_INFINITY and soft >= target:
        return soft, soft
    if soft == resource.RLIM_INFINITY:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]
