"""The fields a newer peer's frames carry that this version skips, told once each.

A peer of a newer minor version may send fields this process does not know; the codec skips them
(:attr:`~epochal.protocol.codec.Decoded.skipped`). The coordinator's service and the worker's
control client each keep one :class:`SkippedFields` and log the lines :meth:`SkippedFields.news`
returns: one per field path the first time a frame carries it, escaped (a peer picks the names),
and no more than :data:`MAX_TOLD` of them, so that a peer inventing names cannot grow the log or
the set without bound.
"""

from __future__ import annotations

from epochal.protocol.codec import Decoded
from epochal.protocol.limits import PROTOCOL_MINOR, PROTOCOL_VERSION
from epochal.text import printable

MAX_TOLD = 32
"""Most field paths one process names; past them it says once that it names no more."""


class SkippedFields:
    """The skipped field paths this process has told of; ``side`` names it in the lines
    ("coordinator", "worker")."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.told: set[str] = set()
        self.silent = False
        # MAX_TOLD paths were told: the rest are skipped without a line

    def news(self, decoded: Decoded) -> list[str]:
        """A log line for each path ``decoded`` skipped that was not told before."""
        lines: list[str] = []
        for path in decoded.skipped:
            if path in self.told or self.silent:
                continue
            if len(self.told) >= MAX_TOLD:
                self.silent = True
                lines.append(
                    f"{MAX_TOLD} unknown fields were skipped and named; further ones are skipped "
                    "without a line"
                )
                break
            self.told.add(path)
            lines.append(
                f"skipped field '{printable(path)}' of a frame from a peer of protocol version "
                f"{PROTOCOL_VERSION}.{decoded.minor}: this {self.side} speaks "
                f"{PROTOCOL_VERSION}.{PROTOCOL_MINOR} and does not know it (said once)"
            )
        return lines
