"""Who is in the run: the rendezvous as a pure state machine.

:class:`Rendezvous` takes each hello with the peer it came from and says what to do with it:
admit it (again, for a retried hello), refuse just that worker (wrong job or token, duplicate,
surplus, rank clash), or abort the whole run (a model that differs between workers: nobody can
tell which side is wrong; the coordinator first fetches both parameter lists to name the
difference, see :mod:`.models`). Job and token are checked before anything else of a hello is
looked at. When ``world_size`` workers are in, :meth:`Rendezvous.assign` gives ranks and picks the
data-plane backend. :class:`JoinLog` says who joined in a few lines, however many workers there
are, and :func:`placement_lines` where the ranks run.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from dataclasses import dataclass

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.loop import missing_monitor
from epochal.coordinator.rules.models import describe_fingerprints
from epochal.protocol import Hello
from epochal.text import printable


@dataclass(frozen=True, slots=True)
class Admitted:
    """The worker is in (or was already in: a retried hello)."""

    again: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """This worker may not join; tell it why. The run goes on."""

    reason: str


@dataclass(frozen=True, slots=True)
class Fatal:
    """The run cannot go on: tell every worker why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Differs:
    """The worker's model has another digest than ``reference``'s (the first member's), with the
    same torch version: the run cannot go on, and only the two parameter lists can say what
    differs. The worker is not admitted."""

    reference: Member


Verdict = Admitted | Refused | Fatal | Differs


@dataclass(frozen=True, slots=True)
class Member:
    """One admitted worker."""

    peer: bytes
    hello: Hello

    def describe(self) -> str:
        h = self.hello
        at = f" at {printable(h.data_address)}" if h.data_address else ""
        return f"worker {printable(h.worker_id)} (host {printable(h.host)}{at}, pid {h.pid})"


def models_differ(difference: str) -> str:
    """The reason a run aborts with when its workers' models differ."""
    return (
        f"the workers' models differ: {difference}; every worker must build the same model with "
        "the same torch version"
    )


NAMED_JOINS = 8
"""Joins logged by name, the first ones; after them, a count now and then."""

JOIN_PROGRESS_SECONDS = 2.0
"""Least time between two lines that count the joins (after the named ones)."""


class JoinLog:
    """The lines a rendezvous logs: the first :data:`NAMED_JOINS` joins by name, then at most one
    count every :data:`JOIN_PROGRESS_SECONDS`, then the one that completes the set; a retried hello
    says nothing. A thousand workers make about a dozen lines, not a thousand flushed ones.
    The clock is an argument."""

    def __init__(
        self,
        world_size: int,
        named: int = NAMED_JOINS,
        every: float = JOIN_PROGRESS_SECONDS,
    ) -> None:
        self.world_size = world_size
        self.named = named
        self.every = every
        self.completed: float | None = None
        # when the last worker joined
        self._said = -math.inf

    def joined(self, now: float, hello: Hello, joined: int) -> list[str]:
        """What to log when the worker of ``hello`` joins as the ``joined``-th one at ``now``."""
        world = self.world_size
        who = f"worker {printable(hello.worker_id)} from {printable(hello.host)}"
        if joined == world:
            self.completed = now
            if world > self.named:
                return [f"all {world} workers joined (the last: {who})"]
        if joined <= self.named or joined == world:
            self._said = now
            return [
                f"worker {printable(hello.worker_id)} joined from {printable(hello.host)} "
                f"({joined}/{world})"
            ]
        if now - self._said < self.every:
            return []
        self._said = now
        return [f"{joined} of {world} workers joined"]

    def crossed(self, now: float, heartbeat_timeout: float) -> bool:
        """Whether a ranked worker's hello at ``now`` is a retry sent before its Joined reached it.

        A worker says hello again on its own only after hearing nothing from the coordinator for
        its heartbeat timeout; until then, within a heartbeat timeout of the last join, a hello
        from a worker with a rank is one it re-sent while its answer was on the way.
        """
        return self.completed is not None and now - self.completed < heartbeat_timeout


class Rendezvous:
    """Collects hellos until ``world_size`` distinct workers are in. O(1) work per hello."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.members: dict[bytes, Member] = {}
        self._by_worker_id: dict[str, bytes] = {}
        self._by_rank_hint: dict[int, bytes] = {}
        self._reference: Member | None = None

    @property
    def complete(self) -> bool:
        return len(self.members) == self.config.world_size

    def offer(self, peer: bytes, hello: Hello) -> Verdict:
        """Judge one hello from ``peer`` (the routing identity it came from)."""
        cfg = self.config
        # job and token first, for every hello: a connection that already joined proves them
        # again each time it says hello (its routing id is the only other thing that binds it)
        if hello.job != cfg.job:
            return Refused(
                f"this coordinator runs job {cfg.job!r}, the worker asked for job "
                f"'{printable(hello.job)}': "
                "point the worker at its own coordinator or set the same job name"
                " (--job / EPOCHAL_JOB)"
            )
        if cfg.token and not hmac.compare_digest(hello.token.encode(), cfg.token.encode()):
            return Refused(
                "wrong or missing job token: give the worker the coordinator's token "
                "(EPOCHAL_TOKEN)"
            )
        known = self.members.get(peer)
        if known is not None:
            if known.hello.worker_id == hello.worker_id:
                return Admitted(again=True)
            return Refused(
                f"connection already joined as worker {printable(known.hello.worker_id)}"
            )
        if hello.worker_id in self._by_worker_id:
            return Refused(
                f"a worker with id '{printable(hello.worker_id)}' has already joined: give every "
                "worker a distinct id (EPOCHAL_WORKER_ID), or stop the duplicate process"
            )
        if self.complete:
            if cfg.elastic:
                return Refused(
                    f"the run already has its {cfg.world_size} workers, the most --world-size "
                    "admits: a newcomer joins this elastic run once a worker is lost"
                )
            return Refused(
                f"the run already has its {cfg.world_size} workers: this worker is surplus; "
                "start exactly --world-size workers"
            )
        hint = hello.rank_hint
        if hint is not None:
            if hint >= cfg.world_size:
                return Refused(
                    f"the worker asks for rank {hint} but the world size is {cfg.world_size}: "
                    f"ranks run 0..{cfg.world_size - 1}"
                )
            if hint in self._by_rank_hint:
                holder = self.members[self._by_rank_hint[hint]]
                return Refused(
                    f"rank {hint} is already taken by {holder.describe()}: give each worker a "
                    "distinct EPOCHAL_RANK, or none"
                )
        if cfg.monitor != "loss" and hello.metrics is not None and cfg.monitor not in hello.metrics:
            # said at the hello: stop before anyone trains, not after the first epoch
            return Fatal(missing_monitor(cfg.monitor, sorted(hello.metrics)))
        member = Member(peer=peer, hello=hello)
        ref = self._reference
        if ref is not None and ref.hello.fingerprint.digest != hello.fingerprint.digest:
            if ref.hello.fingerprint.torch_version == hello.fingerprint.torch_version:
                return Differs(ref)
            diff = describe_fingerprints(
                ref.hello.fingerprint, hello.fingerprint, ref.describe(), member.describe()
            )
            return Fatal(models_differ(diff))
        if ref is None:
            self._reference = member
        self.members[peer] = member
        self._by_worker_id[hello.worker_id] = peer
        if hint is not None:
            self._by_rank_hint[hint] = peer
        return Admitted(again=False)

    @property
    def reference(self) -> Member | None:
        """The member whose model every other must match (the first one in)."""
        return self._reference

    def leave(self, peer: bytes) -> None:
        """Forget a worker that left before the rendezvous completed (it stopped heartbeating)."""
        member = self.members.pop(peer, None)
        if member is None:
            return
        self._by_worker_id.pop(member.hello.worker_id, None)
        if member.hello.rank_hint is not None:
            self._by_rank_hint.pop(member.hello.rank_hint, None)
        if self._reference is member:
            self._reference = next(iter(self.members.values()), None)

    def assign(self) -> tuple[dict[bytes, int], str]:
        """Ranks for every member (hints honoured, the rest in order of arrival) and the backend."""
        ranks: dict[bytes, int] = {}
        free = iter(r for r in range(self.config.world_size) if r not in self._by_rank_hint)
        for peer, member in self.members.items():
            hint = member.hello.rank_hint
            ranks[peer] = hint if hint is not None else next(free)
        backend = self.config.backend
        if backend == "auto":
            all_cuda = all(m.hello.device == "cuda" for m in self.members.values())
            backend = "nccl" if all_cuda else "gloo"
        return ranks, backend


PLACEMENT_LINES = 8
"""Lines that say where the ranks are, at most: a run of thousands of ranks gets a summary."""


def placement_lines(members: Sequence[Member], most: int = PLACEMENT_LINES) -> list[str]:
    """Where each rank runs: one line per run of consecutive ranks on one host and data-plane
    address ("ranks 0-7: node1, data plane at 10.0.0.1"), at most ``most`` lines, then how many
    ranks the rest hold and on how many hosts."""
    groups: list[tuple[int, int, str, str]] = []  # (first rank, last rank, host, address)
    for rank, member in enumerate(members):
        host = printable(member.hello.host)
        where = printable(member.hello.data_address) if member.hello.data_address else "?"
        if groups and groups[-1][1] == rank - 1 and groups[-1][2:] == (host, where):
            groups[-1] = (groups[-1][0], rank, host, where)
        else:
            groups.append((rank, rank, host, where))
    lines = [
        f"{f'rank {a}' if a == b else f'ranks {a}-{b}'}: {host}, data plane at {where}"
        for a, b, host, where in groups[:most]
    ]
    rest = groups[most:]
    if rest:
        ranks = sum(b - a + 1 for a, b, _, _ in rest)
        hosts = len({host for _, _, host, _ in rest})
        lines.append(
            f"... and {ranks} more ranks on {hosts} host{'s' if hosts != 1 else ''} "
            "(`epochal status RUN_DIR` lists every rank)"
        )
    return lines
