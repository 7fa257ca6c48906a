"""Who has gone quiet or stuck: pure liveness checks that take the clock as an argument.

Two kinds of trouble. A peer that sends nothing (dead, frozen, cut off) is :func:`lost` after the
heartbeat timeout. A peer that keeps sending heartbeats but whose training code makes no progress
is a stall: its heartbeats say where its code is (:class:`Progress`), and :func:`culprit` picks the
rank the others wait for, the one stuck in its own code rather than in a collective or waiting for
the coordinator; :func:`stalled` says when to end the run for it (``--stall-abort``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K")


def expired(now: float, last_seen: float, timeout: float) -> bool:
    """True when nothing has been heard for longer than ``timeout`` seconds."""
    return now - last_seen > timeout


def lost(now: float, last_seen: Mapping[K, float], timeout: float) -> list[K]:
    """Every peer that has been silent for longer than ``timeout`` seconds, oldest first."""
    quiet = [(seen, peer) for peer, seen in last_seen.items() if expired(now, seen, timeout)]
    return [peer for _, peer in sorted(quiet, key=lambda item: item[0])]


@dataclass(frozen=True, slots=True)
class Progress:
    """Where one rank's training code was at its last heartbeat, and for how long."""

    rank: int
    phase: str
    # the worker's phase: "train", "validate", "checkpoint", "waiting" (for the coordinator), ...
    epoch: int
    step: int
    idle: float
    # seconds since its (phase, epoch, step) last changed
    where: str
    # the line its main thread executes, "file.py:12 in fn"


# Frames a rank sits in while it waits for its peers inside the data plane: torch.distributed's
# collectives and the autograd engine (DDP's gradient all-reduce completes inside backward).
_WAITING_IN_FRAMEWORK = ("distributed_c10d.py:", "graph.py:", "c10d_logger.py:", " in wait")
# Phases in which a rank waits for the coordinator, that is for the other ranks' reports.
_WAITING_FOR_PEERS = ("waiting", "finishing", "rendezvous")
_PHASE_ORDER = {"rendezvous": 0, "train": 1, "validate": 2, "checkpoint": 3, "finishing": 4}


def moved(before: str | None, after: str) -> bool:
    """Whether a rank's code has moved on between two heartbeats, by the line it executes.

    A training loop that never calls ``ctx.check()`` reports no steps, but its line changes from
    one heartbeat to the next; a hung rank, or one blocked in a collective or waiting for the
    coordinator, stays on one line. (An unknown line, "", is no evidence either way.)
    """
    return before is not None and before != after and after != "" and before != ""


def waits_for_others(row: Progress) -> bool:
    """Whether ``row``'s rank is blocked on its peers (a collective, or the coordinator)."""
    return row.phase in _WAITING_FOR_PEERS or any(m in row.where for m in _WAITING_IN_FRAMEWORK)


def culprit(rows: Sequence[Progress]) -> Progress | None:
    """The rank a stalled run waits for.

    A rank stuck in its own code (a hung data loader, a deadlock in user code) while the others
    wait in a collective or for the coordinator; among several such, or when every rank waits,
    the least advanced (epoch, phase, step), then the one idle the longest.
    """
    if not rows:
        return None
    own = [r for r in rows if not waits_for_others(r)]

    def behind(r: Progress) -> tuple[int, int, int, float]:
        return (r.epoch, _PHASE_ORDER.get(r.phase, 5), r.step, -r.idle)

    return min(own or rows, key=behind)


@dataclass(frozen=True, slots=True)
class Stalled:
    """End the run: ``rank`` has made no progress for ``idle`` seconds, nor has any other."""

    rank: int
    idle: float
    reason: str


def stalled(rows: Sequence[Progress], abort_after: float | None) -> Stalled | None:
    """A verdict once no rank has made progress for more than ``abort_after`` seconds.

    None while any rank progresses (a slow rank the others wait for is slow, not stuck), or when
    ``abort_after`` is None (never abort for a stall).
    """
    if abort_after is None or not rows or min(r.idle for r in rows) <= abort_after:
        return None
    stuck = culprit(rows)
    assert stuck is not None  # rows is not empty
    if waits_for_others(stuck):
        what = "every rank waits for another (a collective that never completes)"
    else:
        what = f"its code is stuck at {stuck.where or 'an unknown line'} while the others wait"
    return Stalled(
        rank=stuck.rank,
        idle=stuck.idle,
        reason=(
            f"rank {stuck.rank} made no progress for {stuck.idle:.0f} s in {stuck.phase} of "
            f"epoch {stuck.epoch} (step {stuck.step}): {what}; ended by --stall-abort "
            f"{abort_after:g} (raise it if steps may legitimately take longer)"
        ),
    )


def stall_table(rows: list[tuple[int, str, str, int, int, float, str]]) -> str:
    """Rows of (rank, host, phase, epoch, step, seconds since progress, where) as a table.

    ``where`` is the line each rank's training code is executing: a rank blocked in a collective
    waits in the framework (backward, all_reduce), the culprit elsewhere. The :func:`culprit` is
    marked.
    """
    if not rows:
        return "(no ranks)"
    stuck = culprit([Progress(r, p, e, s, t, w) for r, _, p, e, s, t, w in rows])
    marked = None if stuck is None else stuck.rank
    header = ("rank", "host", "phase", "epoch", "step", "still for", "at")
    body = [
        (str(r), h, p, str(e), str(s), f"{t:.1f} s" + (" *" if r == marked else ""), w)
        for r, h, p, e, s, t, w in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=False)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in (header, *body)
    ]
    return "\n".join([*lines, "(* the rank the others wait for)"])
