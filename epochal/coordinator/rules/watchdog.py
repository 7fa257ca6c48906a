"""The coordinator's clock rules: silence, lost messages, stalls, failure settle, lost time.

Every method takes ``now`` (seconds on a monotonic clock) as an argument: nothing here reads a
clock, sends or logs, so each rule is tested with a given clock (``tests/coordinator/
test_watchdog.py``). The checks are cheap at any scale: a message costs O(1) (its sender moves to
the end of an ordered map of when each peer was last heard, so the longest-silent peer is always
first); a clock check looks at that first peer, the newest progress and the few ranks suspected of
a lost message. Only a verdict (a stall table, an abort) walks every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules import liveness
from epochal.coordinator.rules.actions import RunPhase
from epochal.coordinator.rules.rendezvous import Member
from epochal.protocol import Awaiting, Status
from epochal.protocol.messages import Phase as WorkerPhase
from epochal.protocol.messages import check_phase
from epochal.text import printable

_ANSWER = {RunPhase.READY: Awaiting.GO, RunPhase.RUNNING: Awaiting.DECISION}
"""The answer a rank waits for while the run's phase collects its message (the batch counts of an
epoch_ready, before the first epoch of a run or of a resume; the loss report, which carries the
next epoch's batch counts): only such a wait can mean that message was lost. A rank still waiting
for the previous epoch's decision (which carries this epoch's Go) is only slow to hear it."""

_SAID = {Awaiting.GO: ("Go", "batch counts"), Awaiting.DECISION: ("decision", "loss report")}
"""The answer awaited and the message it answers, in words."""

FAILURE_SETTLE = 0.25
"""Seconds between the first failure report and the abort, so the cause can arrive too."""

FAILURES_KEPT = 4
"""Failures an abort names, causes first; the others reported in the settle window are counted
(a rank may send many, and each is a line of up to a thousand characters)."""


@dataclass(frozen=True, slots=True)
class RankStatus:
    """A rank's last reported (phase, epoch, step, awaiting) and when that last changed."""

    phase: str
    epoch: int
    step: int
    since: float
    awaiting: str | None = None
    # phase waiting: the answer it waits for (go, decision)


class Watchdog:
    """When each peer was last heard, where each rank is, and the verdicts those imply."""

    def __init__(self, config: CoordinatorConfig, now: float) -> None:
        self.config = config
        self.last_seen: OrderedDict[bytes, float] = OrderedDict()
        # least recently heard first: the values grow from first to last
        self.status: dict[int, RankStatus] = {}
        self.where: dict[int, str] = {}
        # rank -> the line its training code was at in its last heartbeat, escaped and bounded
        # (it is shown in the stall table and status.json)
        self.newest: float | None = None
        # when any rank last made progress (the newest RankStatus.since)
        self.phase_started = now
        self.stall_reported = 0.0
        self._suspects: set[int] = set()
        # ranks that may be waiting for a message of theirs that was lost (checked on the clock)
        self._failures: list[tuple[int, str]] = []
        # (priority, what) reported in the settle window before an abort, at most FAILURES_KEPT;
        # a process exit (0) is the cause, a rank's error after it (1) usually its consequence
        self._failures_dropped = 0
        self.failure_deadline: float | None = None
        self.stall: tuple[float, float] | None = None
        # the latest time this coordinator was not running: (seconds lost, when it ran again)
        self._rehello_logged: dict[int, float] = {}

    # ------------------------------------------------------------------ what arrives

    def phase_began(self, now: float) -> None:
        self.phase_started = now
        self._suspects.clear()  # a wait counts only when first seen after the phase began

    def heard(self, peer: bytes, now: float) -> None:
        """``peer`` sent something at ``now`` (O(1))."""
        self.last_seen[peer] = now
        self.last_seen.move_to_end(peer)

    def knows(self, peer: bytes) -> bool:
        return peer in self.last_seen

    def drop(self, peer: bytes) -> None:
        self.last_seen.pop(peer, None)

    def note_status(self, rank: int, status: Status, now: float) -> None:
        """A heartbeat's status: progress when its (phase, epoch, step) or its line moved."""
        before = self.where.get(rank)
        where = printable(status.where)
        self.where[rank] = where
        moved = liveness.moved(before, where)
        self._note(rank, status.phase, status.epoch, status.step, status.awaiting, now, moved)

    def note_waiting(self, rank: int, epoch: int, awaiting: Awaiting, now: float) -> None:
        """``rank``'s epoch_ready or loss report for ``epoch`` arrived: it now waits for
        ``awaiting``, as its next heartbeat will say (the worker sends no Status of its own for
        that change of phase); its line is the heartbeat's to tell."""
        self._note(rank, WorkerPhase.WAITING, epoch, 0, awaiting, now)

    def _note(
        self,
        rank: int,
        phase: str,
        epoch: int,
        step: int,
        awaiting: str | None,
        now: float,
        moved: bool = False,
    ) -> None:
        """``rank`` is at (phase, epoch, step, awaiting): progress at ``now`` when that differs
        from what it last said, or when its line ``moved``."""
        previous = self.status.get(rank)
        if (
            previous is None
            or moved
            or (previous.phase, previous.epoch, previous.step, previous.awaiting)
            != (phase, epoch, step, awaiting)
        ):
            self.status[rank] = RankStatus(phase, epoch, step, now, awaiting)
            self.newest = now

    def margin(self) -> float:
        """How long a rank must be heard from while it waits before its message counts as lost:
        several heartbeats, so a slow or starved heartbeat thread never looks like a loss."""
        return max(3 * self.config.heartbeat_interval, 2.0)

    def _waits_in_vain(self, rank: int, peer: bytes, epoch: int, answer: Awaiting) -> bool:
        """Whether ``rank`` waits for ``answer`` to ``epoch`` past the margin: only the answer
        the run's phase holds back counts, so a rank still waiting for its Go while the run
        collects loss reports (a wide broadcast reaches some ranks late) is not blamed."""
        status = self.status.get(rank)
        if (
            status is None
            or status.phase != "waiting"
            or status.awaiting != answer
            or status.epoch != epoch
        ):
            return False
        # heard from for longer than the margin while it waits: its link works, so the message
        # was lost; a rank that went silent meanwhile is the heartbeat timeout's to name
        heard = self.last_seen.get(peer, status.since)
        return status.since > self.phase_started and heard - status.since > self.margin()

    def after_message(
        self, rank: int, peer: bytes, phase: RunPhase, epoch: int, answered: Container[int]
    ) -> None:
        """Note ``rank`` as a suspect if it now waits in vain (O(1)).

        Only a message from the rank itself can make its wait count: the other conditions only
        ever stop holding (a new phase, its message arriving), and lost time moves both ends.
        """
        if rank not in answered and self._waits_in_vain(rank, peer, epoch, _ANSWER[phase]):
            self._suspects.add(rank)

    # ------------------------------------------------------------------ verdicts

    def check(
        self,
        now: float,
        *,
        phase: RunPhase,
        epoch: int,
        answered: Container[int],
        members: Sequence[Member],
        ranks: Mapping[bytes, int],
        welcomed: bool,
    ) -> tuple[list[str], str | None]:
        """The clock rules once the ranks are assigned: lines to log, and why to abort (or None).

        In order: rank 0 late with the store, a stall (reported, then ended by
        ``--stall-abort``), a lost message, a silent rank. ``answered``: the ranks whose batch
        counts (phase ready) or loss report (running) arrived; ``welcomed``: the store is open.
        """
        cfg = self.config
        if phase is RunPhase.STORE and now - self.phase_started > cfg.store_timeout:
            return [], (
                f"rank 0 ({members[0].describe()}) did not open the data-plane "
                f"store within {cfg.store_timeout:g} s"
            )
        lines: list[str] = []
        if phase in (RunPhase.READY, RunPhase.RUNNING) and self.status:
            idle = self.stall_due(now)
            if idle is not None:
                lines.append(
                    f"no rank has made progress for {idle:.0f} s "
                    f"(--stall-timeout {cfg.stall_timeout:g}); where each rank is:\n"
                    + liveness.stall_table(self.rows(now, members))
                )
            if self.stall_abort_due(now):
                rows = self.rows(now, members)
                progress = [liveness.Progress(r, p, e, s, t, w) for r, _, p, e, s, t, w in rows]
                stuck = liveness.stalled(progress, cfg.stall_abort)
                if stuck is not None:
                    member = members[stuck.rank]
                    return lines, f"{stuck.reason} [rank {stuck.rank}: {member.describe()}]"
            lost = self.lost_message(now, phase, epoch, answered, members)
            if lost is not None:
                return lines, lost
        silent = self.first_silent(now, ranks)
        if silent is not None:
            peer, seconds = silent
            return lines, self.silence(ranks[peer], seconds, members, welcomed)
        return lines, None

    def silence(
        self, rank: int, seconds: float, members: Sequence[Member], welcomed: bool = True
    ) -> str:
        """Why the run aborts when ``rank`` sent nothing for ``seconds``."""
        return (
            f"rank {rank} ({members[rank].describe()}) sent nothing for "
            f"{seconds:.1f} s{self._doing(rank, welcomed)}: it died, hung or lost its network"
        )

    def _doing(self, rank: int, welcomed: bool) -> str:
        """What ``rank`` last said it was doing (" while connecting the data plane")."""
        status = self.status.get(rank)
        phase = WorkerPhase.RENDEZVOUS if status is None else check_phase(status.phase)
        if phase is WorkerPhase.RENDEZVOUS and welcomed:
            phase = WorkerPhase.CONNECT  # welcomed: a worker connects its data plane next
        return f" while {phase.description}"

    def lost_message(
        self,
        now: float,
        phase: RunPhase,
        epoch: int,
        answered: Container[int],
        members: Sequence[Member],
    ) -> str | None:
        """A rank that says it is waiting for our answer although its message never arrived.

        ``phase``: READY (its epoch_ready is missing, it waits for Go) or RUNNING (its loss
        report, with its batch counts for the next epoch, is missing: it waits for the decision
        that would carry the next epoch's Go)."""
        if not self._suspects:
            return None
        awaited = _ANSWER[phase]
        answer, what = _SAID[awaited]
        for rank in sorted(self._suspects):
            member = members[rank]
            if rank in answered or not self._waits_in_vain(rank, member.peer, epoch, awaited):
                self._suspects.discard(rank)
                continue
            since = self.status[rank].since
            return (
                f"rank {rank} ({member.describe()}) has waited {now - since:.1f} s for "
                f"epoch {epoch}'s {answer}, but its {what} never arrived: a control "
                "message was lost (a faulty link or proxy, or a bug), and the ranks "
                "cannot agree on this epoch without it"
            )
        return None

    def silent(self, now: float) -> list[bytes]:
        """Peers silent for longer than the heartbeat timeout, the longest first."""
        timeout = self.config.heartbeat_timeout
        out = []
        for peer, seen in self.last_seen.items():
            if not liveness.expired(now, seen, timeout):
                break
            out.append(peer)
        return out

    def first_silent(self, now: float, ranked: Container[bytes]) -> tuple[bytes, float] | None:
        """The ranked peer silent the longest beyond the heartbeat timeout, and for how long."""
        for peer, seen in self.last_seen.items():
            if not liveness.expired(now, seen, self.config.heartbeat_timeout):
                return None
            if peer in ranked:
                return peer, now - seen
        return None

    def stall_due(self, now: float) -> float | None:
        """Seconds without progress by any rank, when a stall report is due (once per
        ``--stall-timeout``); else None."""
        timeout = self.config.stall_timeout
        if self.newest is None or now - self.newest <= timeout:
            return None
        if now - self.stall_reported <= timeout:
            return None
        self.stall_reported = now
        return now - self.newest

    def stall_abort_due(self, now: float) -> bool:
        """Whether no rank (those not heard of count from the phase's start) has made progress
        for longer than ``--stall-abort``."""
        limit = self.config.stall_abort
        if limit is None or self.newest is None:
            return False
        latest = self.newest
        if len(self.status) < self.config.world_size:
            latest = max(latest, self.phase_started)
        return now - latest > limit

    def rows(
        self, now: float, members: Sequence[Member]
    ) -> list[tuple[int, str, str, int, int, float, str]]:
        """(rank, host, phase, epoch, step, seconds since progress, where) of every rank."""
        rows = []
        default = RankStatus("?", 0, 0, self.phase_started)
        for rank, member in enumerate(members):
            s = self.status.get(rank, default)
            where = self.where.get(rank, "")
            host = printable(member.hello.host)
            rows.append((rank, host, s.phase, s.epoch, s.step, now - s.since, where))
        return rows

    def new_world(self, now: float) -> None:
        """The ranks were renumbered (a world without its lost ranks): what each said is of
        another rank now, so it is forgotten; the survivors are heard from again by ``now``."""
        self.status.clear()
        self.where.clear()
        self._suspects.clear()
        self.newest = None
        for peer in self.last_seen:  # every value alike: the order stays
            self.last_seen[peer] = now
        self.phase_began(now)

    # ------------------------------------------------------------------ failures

    def clear_failures(self) -> None:
        """The failures reported so far are explained (a lost rank's peers): no abort."""
        self._failures.clear()
        self._failures_dropped = 0
        self.failure_deadline = None

    def report_failure(self, now: float, what: str, *, cause: bool = False) -> None:
        self._failures.append((0 if cause else 1, what))
        if len(self._failures) > FAILURES_KEPT:  # keep the causes, then the first consequences
            self._failures.sort(key=lambda f: f[0])
            self._failures.pop()
            self._failures_dropped += 1
        if self.failure_deadline is None:
            self.failure_deadline = now + FAILURE_SETTLE

    def failure_due(self, now: float) -> str | None:
        """Once the settle window is over: every failure reported, causes first."""
        if self.failure_deadline is None or now < self.failure_deadline:
            return None
        said = "; then ".join(what for _, what in sorted(self._failures, key=lambda f: f[0]))
        dropped = self._failures_dropped
        if dropped:
            said += f"; and {dropped} more failure{'s' if dropped != 1 else ''} reported"
        return said

    def after_lost_time(self, now: float, line: str) -> str:
        """How a rank's failure line reads soon after this coordinator was not running (said once,
        before the first such failure)."""
        stall = self.stall
        if stall is not None and now - stall[1] <= self.config.heartbeat_timeout:
            self.stall = None
            return (
                f"this coordinator was not running for {stall[0]:.1f} s (its process was stopped, "
                f"or the machine suspended or overloaded), and meanwhile {line}"
            )
        return line

    def rehello_due(self, rank: int, now: float) -> bool:
        """Whether a rank's hello in the middle of the run is to be logged (once per timeout)."""
        last = self._rehello_logged.get(rank)
        if last is not None and now - last < self.config.heartbeat_timeout:
            return False
        self._rehello_logged[rank] = now
        return True

    # ------------------------------------------------------------------ lost time

    def forgive(self, now: float, lost: float) -> str | None:
        """Give every rank a fresh window: for ``lost`` seconds nobody here could hear them.

        Returns the line to log when the loss is longer than a heartbeat interval. O(N), and only
        after the coordinator itself was not running.
        """
        for peer in self.last_seen:
            self.last_seen[peer] += lost  # the order stays: every value moves alike
        self.status = {
            rank: RankStatus(s.phase, s.epoch, s.step, s.since + lost, s.awaiting)
            for rank, s in self.status.items()
        }
        if self.newest is not None:
            self.newest += lost
        self.phase_started += lost
        self.stall_reported += lost
        if self.failure_deadline is not None:
            self.failure_deadline += lost
        self.stall = (lost, now)
        if lost > self.config.heartbeat_interval:
            return (
                f"the coordinator itself was not running for {lost:.1f} s (its process was "
                "stopped, or the machine suspended or overloaded): no rank is blamed for that "
                "silence"
            )
        return None
