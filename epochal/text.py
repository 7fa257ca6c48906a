"""Text from outside the process made safe to print: one function, used wherever a string that
a peer, a file or another user wrote reaches a log line or a terminal.

A worker id, a host name, a failure reason or a field of ``status.json`` may hold a newline (a
forged log line), a terminal escape (that drives the reader's terminal) or 60,000 characters;
:func:`printable` shows control characters escaped and cuts the text to a bound. :func:`counted`
says a count with its noun ("1 line", "3 lines"), :func:`exit_words` an exit status.
Standard library only: the coordinator, the
workers and the observers all use it.
"""

from __future__ import annotations

import signal

PRINTABLE_CHARS = 200
"""Longest text :func:`printable` shows by default; longer text is cut and marked."""

REASON_CHARS = 1000
"""Longest failure reason from a peer shown in a log line (a worker's ``Failed``, a codec error
about its frame): long enough for an exception's message, short of a flood."""


def printable(text: object, limit: int = PRINTABLE_CHARS) -> str:
    """``text`` safe to print into a log: control characters shown escaped (``\\n``, ``\\x1b``),
    at most ``limit`` characters, a cut marked with ``...``. A non-string is shown as its str."""
    if not isinstance(text, str):
        text = str(text)
    if len(text) <= limit and text.isprintable():
        return text
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, the noun in the plural (``plural``, else ``noun + "s"``) unless ``n``
    is 1: ``"1 line"``, ``"3 lines"``, ``"0 lines"``."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


def exit_words(code: int) -> str:
    """A worker's exit status in words: "exited with status 3", "was killed by SIGKILL"."""
    if code >= 0:
        return f"exited with status {code}"
    return f"was killed by {signal.Signals(-code).name}"


def byte_size(n: float) -> str:
    """A number of bytes for a reader: "812 B", "3.4 KiB", "25.2 MiB", "1.50 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"
