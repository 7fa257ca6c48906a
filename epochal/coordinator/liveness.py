"""Who has gone quiet: pure liveness checks that take the clock as an argument."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

K = TypeVar("K")


def expired(now: float, last_seen: float, timeout: float) -> bool:
    """True when nothing has been heard for longer than ``timeout`` seconds."""
    return now - last_seen > timeout


def lost(now: float, last_seen: Mapping[K, float], timeout: float) -> list[K]:
    """Every peer that has been silent for longer than ``timeout`` seconds, oldest first."""
    quiet = [(seen, peer) for peer, seen in last_seen.items() if expired(now, seen, timeout)]
    return [peer for _, peer in sorted(quiet, key=lambda item: item[0])]


def stall_table(rows: list[tuple[int, str, str, int, int, float, str]]) -> str:
    """Rows of (rank, host, phase, epoch, step, seconds since progress, where) as a table.

    ``where`` is the line each rank's training code is executing: a rank blocked in a collective
    waits in the framework (backward, all_reduce), the culprit elsewhere. The rank whose progress
    is oldest is marked.
    """
    if not rows:
        return "(no ranks)"
    oldest = max(r[5] for r in rows)
    header = ("rank", "host", "phase", "epoch", "step", "still for", "at")
    body = [
        (str(r), h, p, str(e), str(s), f"{t:.1f} s" + (" *" if t == oldest else ""), w)
        for r, h, p, e, s, t, w in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=False)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *body)
    ]
    return "\n".join([*lines, "(* no progress for the longest)"])
