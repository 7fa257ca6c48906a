"""Epochal's named loggers and the one handler that writes them.

Every part logs through a logger of its own — ``epochal.coordinator``, ``epochal.worker``,
``epochal.launcher``, ``epochal.security`` — instead of printing. The messages are whole lines
already written for a person (the epoch line, a cause said once), so the default ("text") format
writes the message alone, exactly as it was printed before. ``json`` writes one object a line for
log collectors: ``{"time", "level", "logger", "message"}``.

:func:`configure` installs the handler once on the ``epochal`` logger; :func:`ensure_configured`
does so with the defaults only where nobody has (a hand-started worker, a library user), so that a
message is never lost to logging's last-resort handler, which drops everything below WARNING. The
handler looks up ``sys.stderr`` at every write, so a stream swapped after start (pytest's capture,
a user's redirect) still receives the lines.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Literal, TextIO

from epochal.environment import LOG_FORMAT_ENV, LOG_LEVEL_ENV

ROOT = "epochal"
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
Format = Literal["text", "json"]

COORDINATOR = logging.getLogger("epochal.coordinator")
WORKER = logging.getLogger("epochal.worker")
LAUNCHER = logging.getLogger("epochal.launcher")


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler bound to whatever ``sys.stderr`` is at the moment of writing."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # logging's constructor assigns it; ignored
        pass


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def _installed() -> _StderrHandler | None:
    for handler in logging.getLogger(ROOT).handlers:
        if isinstance(handler, _StderrHandler):
            return handler
    return None


def configure(level: str = "info", fmt: str = "text") -> None:
    """Install (or re-set) epochal's handler: ``level`` one of :data:`LEVELS`, ``fmt`` one of
    :data:`FORMATS`. Raises ``ValueError`` naming the accepted values for anything else."""
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    root = logging.getLogger(ROOT)
    handler = _installed()
    if handler is None:
        handler = _StderrHandler()
        root.addHandler(handler)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else logging.Formatter("%(message)s"))
    root.setLevel(level.upper())
    root.propagate = False  # the lines are written once, here, not again by a root handler


def ensure_configured() -> None:
    """Configure from ``EPOCHAL_LOG_LEVEL`` / ``EPOCHAL_LOG_FORMAT`` (defaults info, text) unless
    :func:`configure` already ran in this process. ``epochal run`` sets both for its workers."""
    if _installed() is None:
        configure(
            os.environ.get(LOG_LEVEL_ENV, "info") or "info",
            os.environ.get(LOG_FORMAT_ENV, "text") or "text",
        )


def child_environment() -> dict[str, str]:
    """``EPOCHAL_LOG_LEVEL`` and ``EPOCHAL_LOG_FORMAT`` as this process is configured (see
    :func:`ensure_configured`): what a process epochal starts needs to log the same way."""
    ensure_configured()
    handler = _installed()
    fmt = (
        "json" if handler is not None and isinstance(handler.formatter, _JsonFormatter) else "text"
    )
    level = logging.getLevelName(logging.getLogger(ROOT).getEffectiveLevel()).lower()
    return {LOG_LEVEL_ENV: level if level in LEVELS else "info", LOG_FORMAT_ENV: fmt}
