"""Who may speak to the run: sessions, peers outside it, and how many refusals reach the log.

The rules bound what a stranger (a peer that is not a member of the run) can make the coordinator
do. :class:`Strangers` answers a misconfigured worker a few times and then drops its frames unread,
holding a bounded count; :class:`Budget` bounds the time the coordinator spends on the frames of
all strangers together each second (:data:`STRANGER_SHARE`, measured, not guessed from their size),
however many identities they use, so that a flood costs a bounded share of its time and the clock
rules keep running; :class:`RefusalLog` logs at most :data:`REFUSALS_LOGGED` refusals a minute and
counts the rest; :class:`Gate` puts them together with the members' sessions, in front of the run's
:class:`~epochal.coordinator.rules.machine.RunMachine`. Members are never throttled. The clock is an
argument, so the rules are tested without sockets or sleeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from epochal.coordinator.rules.actions import Action, Log, Send
from epochal.coordinator.rules.rendezvous import Member
from epochal.coordinator.rules.sessions import Sessions
from epochal.protocol import Heartbeat, Hello, Message, Reject, Status, clip
from epochal.text import printable

REFUSALS_LOGGED = 20
"""Refused hellos logged per minute; the rest are counted."""

STRANGER_REPLIES = 8
"""Rejections a peer outside the run gets before its frames are dropped unanswered."""

MAX_STRANGERS = 4096
"""Peers outside the run whose rejections are counted; the least recent are forgotten."""

STRANGER_SHARE = 0.1
"""Seconds of the coordinator's time per second that the frames of all strangers together may
take: a tenth of a core, however many identities they use and whatever their frames hold. What a
frame took is measured (the thread's CPU time from its arrival to the answer), not assumed from
its size: 64 KiB frames can cost 0.3 ms or 24 ms to read, as the bytes an attacker picks
decide. Past the share their frames are dropped unread until it refills. The hellos of a
rendezvous of 4,096 workers, retries included, fit in it (a hello takes about 30 µs)."""

STRANGER_BURST = 0.1
"""Seconds the strangers may take at once after a quiet spell, and the most time their frames can
be owed (one frame read on the last of the share may cost more than was left): a flood that
ended leaves the strangers' next hellos, a joining worker's among them, read within a second."""


class Budget:
    """A budget of time: on average at most ``rate`` seconds of work a second, ``burst`` at once.

    Work is spent after it is done, since only then is its cost known, so the level may fall
    below zero, at most to ``-burst``; no more work is begun until it is above zero again."""

    def __init__(self, rate: float = STRANGER_SHARE, burst: float = STRANGER_BURST) -> None:
        self.rate = rate
        self.burst = burst
        self._level = burst
        self._at: float | None = None

    def _refill(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now if self._at is None else max(self._at, now)

    def open(self, now: float) -> bool:
        """Whether work may begin at ``now``: the budget is not spent."""
        self._refill(now)
        return self._level > 0

    def spend(self, now: float, seconds: float) -> None:
        """Count ``seconds`` of work done at ``now``."""
        self._refill(now)
        self._level = max(-self.burst, self._level - seconds)


class Strangers:
    """Rejections sent to each peer outside the run, the least recent forgotten first."""

    def __init__(self, replies: int = STRANGER_REPLIES, remembered: int = MAX_STRANGERS) -> None:
        self.replies = replies
        self.remembered = remembered
        self._sent: OrderedDict[bytes, int] = OrderedDict()

    def spent(self, peer: bytes) -> bool:
        """Whether ``peer`` has had all its answers: its frames are dropped unread."""
        return self._sent.get(peer, 0) >= self.replies

    def answer(self, peer: bytes) -> bool:
        """Count one rejection for ``peer``; whether it is still to be sent."""
        sent = self._sent.pop(peer, 0)
        self._sent[peer] = sent + 1  # most recent last
        if len(self._sent) > self.remembered:
            self._sent.popitem(last=False)
        return sent < self.replies


class RefusalLog:
    """At most ``per_minute`` refusal lines a minute; the lines past that are counted."""

    def __init__(self, per_minute: int = REFUSALS_LOGGED) -> None:
        self.per_minute = per_minute
        self._window = 0.0
        self._shown = 0
        self._hidden = 0

    def lines(self, now: float, line: str) -> list[str]:
        """What to log for one refusal at ``now``: the line, a count of the last minute's hidden
        ones before it, or nothing."""
        out: list[str] = []
        if now - self._window > 60:
            if self._hidden:
                out.append(f"... and {self._hidden} more refusals in that minute")
            self._window, self._shown, self._hidden = now, 0, 0
        if self._shown < self.per_minute:
            self._shown += 1
            out.append(line)
        else:
            self._hidden += 1
        return out


class Gate:
    """What a frame must pass before the run acts on it, and the count of those that did not."""

    def __init__(self) -> None:
        self.sessions = Sessions()
        self.strangers = Strangers()
        self.budget = Budget()
        self._refusals = RefusalLog()
        self.dropped_frames = 0
        # frames that could not be read (malformed, oversized, another protocol version)
        self.ignored_frames = 0
        # frames from strangers past their reply budget or the strangers' budget, dropped unread
        self.forged_frames = 0
        # frames under a member's routing identity without its session (or key): never acted on

    def summary(self) -> str | None:
        """The line that counts the frames not acted on, said as the run ends; None if none."""
        if not (self.dropped_frames or self.ignored_frames or self.forged_frames):
            return None
        forged = (
            f" and {self.forged_frames} sent under a worker's identity without its session"
            if self.forged_frames
            else ""
        )
        return (
            f"dropped {self.dropped_frames} unreadable frames and ignored "
            f"{self.ignored_frames} more from peers outside the run{forged}"
        )

    def reads(self, now: float, peer: bytes) -> bool:
        """Whether a frame from ``peer`` is worth reading at ``now``: a member's always; a
        stranger's while it has answers left and the strangers' share of time is not spent (what
        reading it took is then counted with :meth:`took`)."""
        if peer in self.sessions:
            return True
        if self.strangers.spent(peer) or not self.budget.open(now):
            self.ignored_frames += 1
            return False
        return True

    def took(self, now: float, seconds: float) -> None:
        """A stranger's frame, read at ``now``, took ``seconds`` of the coordinator's time."""
        self.budget.spend(now, seconds)

    def reject(self, peer: bytes, reason: str, code: str) -> list[Action]:
        """Answer a peer that is not in the run, a few times; after that, drop it silently.

        A misconfigured worker gets its explanation; a peer that keeps sending junk cannot make
        the coordinator do unbounded work or hold unbounded state (at most MAX_STRANGERS counted).
        """
        if not self.strangers.answer(peer):
            self.ignored_frames += 1
            return []
        return [Send(peer, Reject(reason=clip(reason), code=code))]

    def refusal(self, now: float, line: str) -> list[Action]:
        """Log a refusal, unless this minute's share is spent."""
        return [Log(text) for text in self._refusals.lines(now, line)]

    def screen(
        self,
        now: float,
        peer: bytes,
        message: Message,
        session: str,
        user_id: str,
        who: Callable[[bytes], Member | None],
    ) -> list[Action] | None:
        """None when the run may act on ``message`` (a hello: see :meth:`hello_refused`); else
        what to do instead, maybe nothing. A frame under a member's routing identity must carry
        its session and come from its key."""
        if isinstance(message, Hello):
            return None
        if peer not in self.sessions or self.sessions.check(peer, session, user_id):
            return None
        if not session and isinstance(message, Heartbeat | Status):
            # a heartbeat without a session may cross the Joined that carries it: dropped quietly
            return []
        self.forged_frames += 1
        if isinstance(message, Heartbeat | Status):
            return []  # harmless to the run: counted, not logged
        member = who(peer)
        return self.refusal(
            now,
            f"dropped a {type(message).__name__} sent as "
            f"{member.describe() if member is not None else 'a worker'} without its session: "
            "another process is using that worker's identity (its frames are ignored)",
        )

    def hello_refused(
        self, now: float, peer: bytes, hello: Hello, user_id: str
    ) -> list[Action] | None:
        """None when ``hello`` may speak for ``peer``; else what to do: its connection is bound
        to another worker's key."""
        if self.sessions.same_sender(peer, user_id):
            return None
        self.forged_frames += 1
        return self.refusal(
            now,
            f"refused a hello as {printable(hello.worker_id)}: its connection is bound to "
            "another worker's key",
        )
