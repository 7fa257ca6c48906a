"""How ``epochal run`` shows its workers' output: one stream, each line prefixed with its rank.

When a run fails, every rank has something to say, and most of it is noise: a rank whose peer died
prints gloo's "Connection closed by peer" traceback, every rank of an aborted run prints ``epochal:
RunAborted: ...`` repeating the coordinator's reason (a worker's one line for an error that stops
the run, :mod:`epochal.worker.control.exits`), Ctrl-C leaves ``KeyboardInterrupt`` tracebacks and
half-drawn progress bars. So a worker's traceback, or that one line, is held back until the worker
has exited, and then judged by its exception line:

- a user's own exception is shown, once (from the first rank that printed it);
- epochal's own errors (``RunAborted``, ``JoinRefused``, ...) are shown as their one exception
  line, once, unless the coordinator already gave the same reason;
- ``KeyboardInterrupt`` and the data plane's errors about a peer that went away are consequences
  of a cause the coordinator has already named, and are hidden.

Once the run is aborted or interrupted, whatever else the workers print is hidden too; the
launcher's last line says how many lines it hid. ``--verbose`` turns all of this off.

torch.distributed prefixes each line of a traceback with ``[rankN]: ``; where N is the rank of
the line's own prefix, that says nothing new and is dropped (``[rank 1] Traceback ...``, not
``[rank 1] [rank1]: Traceback ...``). :func:`in_words` says what a data-plane error about a lost
peer means, for the line that names the cause of an abort (gloo's own text, with its source
path, peer address and sign-off, stays in the worker's output).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TextIO

TRACEBACK_START = "Traceback (most recent call last):"
_TORCH_PREFIX = re.compile(r"^\[rank(\d+)\]: ?")
"""torch.distributed's excepthook prefixes every traceback line with ``[rankN]: ``."""
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(: |$)")
_EPOCHAL_ERROR = re.compile(r"^epochal\.errors\.\w+: ")
_ONE_LINE = re.compile(r"^epochal: ([A-Z]\w*): (.*)$")
"""A worker's one line for an error that stops the run: ``epochal: RunAborted: <reason>``."""
_CONSEQUENCES = (
    "KeyboardInterrupt",
    "Connection closed by peer",
    "Connection reset by peer",
    "DistBackendError",
    "DistNetworkError",
    "Broken pipe",
)
"""Exception lines that follow from a cause reported elsewhere (a signal, a dead peer)."""
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)
"""What gloo (and NCCL) say when a connection to another rank of the data plane went away."""
_DATA_PLANE_ERRORS = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError")
"""The exceptions torch.distributed raises them as (a user's own BrokenPipeError is not one)."""
PEER_LOST = "its connection to a peer of the data plane closed (the peer process probably died)"


class Kind(enum.Enum):
    USER = "user"
    EPOCHAL = "epochal"
    CONSEQUENCE = "consequence"


def classify(exception_line: str) -> Kind:
    """What a traceback ending in ``exception_line`` (without torch's prefix) is."""
    if _EPOCHAL_ERROR.match(exception_line):
        return Kind.EPOCHAL
    if any(mark in exception_line for mark in _CONSEQUENCES):
        return Kind.CONSEQUENCE
    return Kind.USER


def in_words(exception_line: str) -> str | None:
    """What ``exception_line`` (``RuntimeError: [../pair.cc:553] Connection closed by peer
    [127.0.0.1]:4821``) means, in words, when it is the data plane losing a peer; None for any
    other error, whose own text says it best."""
    name, colon, message = exception_line.partition(": ")
    if not colon or name.rsplit(".", 1)[-1] not in _DATA_PLANE_ERRORS:
        return None
    if any(mark in message for mark in _PEER_LOST):
        return PEER_LOST
    return None


def strip_own_rank(line: str, rank: int | None) -> str:
    """``line`` without torch.distributed's ``[rankN]: `` prefix when N is ``rank`` (the rank
    the line is already prefixed with); any other line as it is."""
    if rank is None:
        return line
    match = _TORCH_PREFIX.match(line)
    if match is None or int(match.group(1)) != rank:
        return line
    return line[match.end() :]


@dataclass(slots=True)
class _Held:
    """A rank's output from its first traceback line to its end."""

    prefix: str
    lines: list[str] = field(default_factory=list)
    exception: str = ""


class Relay:
    """The workers' output of one attempt of ``epochal run``, shared by the ranks' streams."""

    def __init__(self, out: TextIO, *, verbose: bool = False) -> None:
        self.out = out
        self.verbose = verbose
        self.stopped = False
        """Set once the run is aborted or interrupted: what the workers print after is hidden."""
        self.hidden = 0
        self.hidden_causes: list[str] = []
        """The errors among the hidden lines that an abort's reason points to (a data-plane
        error said in words, :func:`in_words`): ``RuntimeError``, once each."""
        self._held: list[_Held] = []

    def stream(self, prefix: str, rank: int | None = None) -> RankStream:
        return RankStream(prefix, self.out, self, rank=rank)

    def stop(self) -> None:
        """The run was aborted or interrupted: from now on, worker output is noise."""
        self.stopped = True

    def hold(self, prefix: str) -> _Held:
        held = _Held(prefix)
        self._held.append(held)
        return held

    def release(self, known_reasons: str = "") -> None:
        """Show the held tracebacks that say something new; call once every worker has ended.

        ``known_reasons`` is what the coordinator already printed: an epochal error repeating it
        is not shown again.
        """
        shown: set[str] = set()
        for held in self._held:
            kind = classify(held.exception)
            if kind is Kind.USER and held.exception not in shown:
                shown.add(held.exception)
                for line in held.lines:
                    self.out.write(line)
                continue
            if kind is Kind.EPOCHAL and held.exception not in shown:
                reason = held.exception.split(": ", 1)[1]
                shown.add(held.exception)
                if reason[:60] not in known_reasons:
                    self.out.write(f"{held.prefix}{held.exception}\n")
                    self.hidden += len(held.lines) - 1
                    continue
            self._hide(held)
        self._held.clear()
        self.out.flush()

    def _hide(self, held: _Held) -> None:
        self.hidden += len(held.lines)
        if in_words(held.exception) is not None:
            name = held.exception.partition(":")[0].rsplit(".", 1)[-1]
            if name not in self.hidden_causes:
                self.hidden_causes.append(name)


class RankStream:
    """Copies one worker's output to ``out`` line by line, each line prefixed with its rank.

    Carriage returns (progress bars) are kept, so a bar redraws in place on a terminal. Without a
    relay every line is copied; with one, the relay's rules above apply. ``rank``: the rank the
    prefix names, whose ``[rankN]: `` from torch.distributed is dropped.
    """

    def __init__(
        self, prefix: str, out: TextIO, relay: Relay | None = None, *, rank: int | None = None
    ) -> None:
        self.prefix = prefix
        self.out = out
        self.relay = relay
        self.rank = rank
        self.pending = ""
        self._held: _Held | None = None
        self._in_frames = False

    def feed(self, text: str) -> None:
        self.pending += text
        while True:
            cut = min(
                (i for i in (self.pending.find("\n"), self.pending.find("\r")) if i >= 0),
                default=-1,
            )
            if cut < 0:
                return
            line, end = self.pending[:cut], self.pending[cut]
            self.pending = self.pending[cut + 1 :]
            if line or end == "\n":
                self._line(line, end)

    def close(self) -> None:
        if self.pending:
            self._line(self.pending, "\n")
            self.pending = ""
        self.out.flush()

    def _line(self, line: str, end: str) -> None:
        line = strip_own_rank(line, self.rank)
        text = f"{self.prefix}{line}{end}"
        relay = self.relay
        if relay is None or relay.verbose:
            self.out.write(text)
            self.out.flush()
            return
        bare = _TORCH_PREFIX.sub("", line)
        one_line = _ONE_LINE.match(bare) if self._held is None else None
        if one_line is not None:
            name, what = one_line.groups()
            held = relay.hold(self.prefix)
            held.lines.append(text if end == "\n" else f"{text}\n")
            # judged like the last line of the traceback it stands for
            bare_exception = f"{name}: {what}"
            consequence = classify(bare_exception) is Kind.CONSEQUENCE
            held.exception = bare_exception if consequence else f"epochal.errors.{bare_exception}"
            return
        if self._held is None and bare.startswith(TRACEBACK_START):
            self._held = relay.hold(self.prefix)
        if self._held is not None:
            self._held.lines.append(text if end == "\n" else f"{text}\n")
            if bare.startswith(TRACEBACK_START):
                self._in_frames = True
            elif self._in_frames and not bare.startswith(" "):
                self._in_frames = False
                if _EXCEPTION_LINE.match(bare):
                    self._held.exception = bare
            return
        if relay.stopped:
            relay.hidden += 1
            return
        self.out.write(text)
        self.out.flush()
