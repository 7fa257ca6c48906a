"""How a worker process ends on an error that stops the run, without a traceback wall.

When a run is aborted, every rank raises :class:`~epochal.errors.RunAborted` carrying the
coordinator's reason; a traceback through the training script on each rank only buries that
reason. :func:`install`, called by :func:`~epochal.worker.join.join`, puts one hook in front of
:data:`sys.excepthook` (once per process, chained to the hook that was there) so that an uncaught

- :class:`~epochal.errors.RunAborted` (also :class:`~epochal.errors.CoordinatorLost`) or
  :class:`~epochal.errors.JoinRefused` prints ``epochal: RunAborted: <reason>``, one line, and the
  process exits with status 1, as it would with the traceback;
- :class:`~epochal.errors.CoordinatorUnreachable` prints one line and exits at once with
  :attr:`~epochal.errors.CoordinatorUnreachable.exit_code`, which ``epochal worker`` reads as "do
  not restart";
- ``KeyboardInterrupt`` prints one line (naming the abort, when one had arrived);
- an error of the data plane about a peer that went away (gloo's "Connection closed by peer")
  prints one line: it is the consequence of another rank's failure, which that rank reports;
- anything else (the user's own exception) goes to the previous hook: its traceback, once.

``EPOCHAL_VERBOSE=1`` (set by ``epochal run --verbose`` and ``epochal worker --verbose``) keeps
every traceback. :func:`one_line` is the decision, pure; the hook prints what it decided.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType

from epochal.environment import VERBOSE_ENV
from epochal.errors import CoordinatorUnreachable, JoinRefused, RunAborted
from epochal.output import Kind, classify, in_words

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]

_QUIET = (RunAborted, JoinRefused, CoordinatorUnreachable)
"""Errors that say all there is to say in their message."""

_installed = False
_aborted: Callable[[], str | None] = lambda: None  # noqa: E731 - replaced by install()


def one_line(exc: BaseException, *, abort_reason: str | None, verbose: bool) -> str | None:
    """The one line to print instead of ``exc``'s traceback, or None to show the traceback.

    ``abort_reason`` is the reason of the abort this worker received (None: none arrived).
    """
    if verbose:
        return None
    if isinstance(exc, _QUIET):
        return f"epochal: {type(exc).__name__}: {exc}"
    if isinstance(exc, KeyboardInterrupt) or _interrupted(exc):
        if abort_reason is not None:
            return f"epochal: KeyboardInterrupt: after the run was aborted: {abort_reason}"
        return f"epochal: KeyboardInterrupt: interrupted ({VERBOSE_ENV}=1 shows where)"
    first = (str(exc).strip().splitlines() or [""])[0]
    if classify(f"{type(exc).__name__}: {first}") is Kind.CONSEQUENCE:
        # the same judgement epochal run's relay makes of a worker's traceback
        return (
            f"epochal: {type(exc).__name__}: {first[:300]} (this rank lost a peer of the data "
            "plane; the rank that failed first says why)"
        )
    return None


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt was handled: an interrupt inside a
    library's ``with`` block (torch.save's zip writer) ends in the error its cleanup raises."""
    seen: set[int] = set()
    cause = exc.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__
    return False


def is_verbose(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether ``EPOCHAL_VERBOSE`` asks for every traceback."""
    return environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def make_hook(previous: ExceptHook, aborted: Callable[[], str | None]) -> ExceptHook:
    """An excepthook that prints :func:`one_line` where there is one, else calls ``previous``."""

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        line = one_line(value, abort_reason=aborted(), verbose=is_verbose())
        if line is None:
            previous(kind, value, tb)
        else:
            sys.stdout.flush()
            # sys.stderr, not the real one: torch.distributed's hook around this one captures
            # it to prefix the line with the rank
            print(line, file=sys.stderr, flush=True)
        if isinstance(value, CoordinatorUnreachable):
            # nothing of the run was started, so nothing needs cleaning up; the status tells a
            # supervisor that a restart would only wait again
            sys.stderr.flush()
            os._exit(CoordinatorUnreachable.exit_code)

    return hook


def install(aborted: Callable[[], str | None] = lambda: None) -> None:
    """Put the hook in front of :data:`sys.excepthook`, once per process.

    ``aborted`` returns the reason of the abort this worker received, or None; a later call (a
    second :func:`~epochal.worker.join.join` in the same process) replaces it.
    """
    global _installed, _aborted
    _aborted = aborted
    if _installed:
        return
    _installed = True
    sys.excepthook = make_hook(sys.excepthook, lambda: _aborted())


def failure_reason(exc: BaseException) -> str:
    """Why this rank stops, for the coordinator's abort line: the exception as Python prints its
    last line, or, for the data plane losing a peer, what that means in words (the backend's own
    text, source path and peer address included, stays in this worker's output)."""
    said = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    words = in_words(said)
    if words is None:
        return said
    return f"{words}; the {type(exc).__name__} it raised is in this worker's output"


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is the data plane losing a peer: the consequence of something that
    happened elsewhere, which another rank or the coordinator names."""
    said = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return isinstance(exc, Exception) and in_words(said) is not None
