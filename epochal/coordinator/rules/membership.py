"""Who is in the run: the world of one generation, the newcomers waiting for a boundary, the ranks
lost, and the decision of a new world, as pure rules with the clock passed in.

A run's **world** is its members by rank under a **generation** number that changes with every new
world. When ranks are lost (a process exit, a ``failed``, a silence past the heartbeat timeout, a
closed connection), :class:`Membership` collects the losses that come together (a settle window: one
kill often shows as an exit and then as its peers' broken collectives) and then decides: with at
least ``min_workers`` left (counting the newcomers waiting, up to ``max_workers``), a new world of
the survivors, in their order, renumbered from 0, with those newcomers appended; with fewer, or no
survivor to hold the state, the end of the run, naming every rank lost. A newcomer that arrives
while the run trains waits as a standby and is admitted at the next epoch boundary
(:meth:`Membership.at_boundary`). A process that was dropped from the run (it went silent and came
back, say) is refused when it says hello again: its generation is gone.

The restore a new world needs follows from what the members' copies hold
(:meth:`~epochal.protocol.SnapshotScope.restore_after`): from each survivor's
in-memory copy of the epoch's start where every rank holds the whole state, else from the last
committed checkpoint, resharded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from epochal.coordinator.rules.rendezvous import Member
from epochal.protocol import Restore, SnapshotScope
from epochal.text import printable

LOSS_SETTLE = 0.25
"""Seconds between the first loss and the new world, so that losses that come together (two
workers of one host, an exit and its neighbours' broken collectives) make one change. The window
closes early once every other rank of the world is known alive (it reported its broken
collective, or was heard after the loss), but not before :data:`LOSS_SETTLE_LEAST`.

A loss found by its silence holds the window open while another rank is unheard since, up to the
heartbeat timeout (the caller's ``hold``): ranks cut off together (a host's link down, a paused
machine) fall silent together, but their last heartbeats came up to an interval apart (more on a
loaded machine), so their timeouts expire apart. Every live rank is heard within about an
interval, and every silent one is found silent within the timeout, so the window closes once each
is one or the other, and the silent ones make one change instead of a world formed with a rank
that is already gone."""

LOSS_SETTLE_LEAST = 0.1
"""Seconds the settle window lasts at the least, every rank heard or not: a rank that reported its
broken collective can still die of the same cause a few milliseconds later (processes of one
host killed one after another, a shutdown's signals), and its loss belongs to the same change."""

DROPPED_REMEMBERED = 4096
"""Dropped processes remembered to refuse their return; the oldest are forgotten first."""


@dataclass(frozen=True, slots=True)
class World:
    """The members of one generation, by rank."""

    generation: int
    members: tuple[Member, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, peer: bytes) -> int | None:
        for rank, member in enumerate(self.members):
            if member.peer == peer:
                return rank
        return None

    def ranks(self) -> dict[bytes, int]:
        """Each member's rank, by routing identity."""
        return {m.peer: rank for rank, m in enumerate(self.members)}


@dataclass(frozen=True, slots=True)
class Loss:
    """One rank lost from the current world, and why."""

    rank: int
    member: Member
    why: str

    def describe(self) -> str:
        return f"rank {self.rank} ({self.member.describe()}) {self.why}"


@dataclass(frozen=True, slots=True)
class NewWorld:
    """The decision: the next world, who left it and who joined, and how it restores."""

    world: World
    previous: World
    lost: tuple[Loss, ...]
    joined: tuple[Member, ...]
    restore: Restore
    since: float
    # when the change began (the first loss, or the boundary that admits newcomers)
    checkpoint: int | None = None
    # restore CHECKPOINT: the epoch of the checkpoint every member loads (the coordinator's)

    @property
    def survivors(self) -> tuple[Member, ...]:
        return tuple(m for m in self.world.members if m not in self.joined)

    def summary(self) -> str:
        """ "4 -> 3 workers (lost rank 2), generation 1"."""
        parts = []
        if self.lost:
            parts.append(f"lost {', '.join(f'rank {loss.rank}' for loss in self.lost)}")
        if self.joined:
            names = ", ".join(printable(m.hello.worker_id) for m in self.joined)
            parts.append(f"joined {names}")
        return (
            f"{self.previous.size} -> {self.world.size} workers ({'; '.join(parts)}), "
            f"generation {self.world.generation}"
        )


@dataclass(frozen=True, slots=True)
class TooFew:
    """The decision when fewer than ``min_workers`` would remain: the run ends."""

    lost: tuple[Loss, ...]
    left: int
    least: int

    def reason(self) -> str:
        said = "; ".join(loss.describe() for loss in self.lost)
        return (
            f"{said}: {self.left} worker{'s' if self.left != 1 else ''} left, fewer than "
            f"--min-workers {self.least}; the run cannot go on"
        )


class Membership:
    """The world, its pending losses, the standby newcomers and the dropped processes."""

    def __init__(self, min_workers: int, max_workers: int) -> None:
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.world: World | None = None
        self.standby: OrderedDict[bytes, Member] = OrderedDict()
        # newcomers admitted while the run trains, in order of arrival, waiting for a boundary
        self._lost: dict[int, Loss] = {}
        self._alive: set[int] = set()
        # ranks of this world known alive since the first pending loss: a broken collective
        # reported, or anything heard
        self._settle: float | None = None
        self._since: float | None = None
        self._dropped: OrderedDict[tuple[str, str, int], str] = OrderedDict()
        # (worker id, host, pid) of each process dropped from the run -> why

    @property
    def elastic(self) -> bool:
        """Whether the run may go on with fewer workers than it started with."""
        return self.min_workers < self.max_workers

    def form(self, members: tuple[Member, ...], generation: int = 0) -> World:
        """The first world, from the rendezvous (generation 0), or the world a restarted
        coordinator took back (the generation its journal holds)."""
        self.world = World(generation, members)
        self._alive.clear()
        return self.world

    # ------------------------------------------------------------------ losses

    def lose(self, now: float, rank: int, why: str, *, hold: float = 0.0) -> bool:
        """Note ``rank`` of the current world lost at ``now``; False when it already was (or is
        no rank). The decision comes when :meth:`due` says so: at the latest :data:`LOSS_SETTLE`
        after the first loss, or ``hold`` seconds after this one if that is later (a loss found
        by its silence)."""
        world = self.world
        if world is None or not 0 <= rank < world.size or rank in self._lost:
            return False
        self._lost[rank] = Loss(rank, world.members[rank], why)
        if self._since is None or self._settle is None:
            self._since = now
            self._settle = now + LOSS_SETTLE
        self._settle = max(self._settle, now + hold)
        return True

    @property
    def losing(self) -> bool:
        """Losses noted and not yet decided on."""
        return bool(self._lost)

    def lost_ranks(self) -> frozenset[int]:
        return frozenset(self._lost)

    def broken(self, rank: int) -> None:
        """``rank`` of the current world reported that a collective broke: it is alive and
        waits for the next world."""
        self._alive.add(rank)

    def heard(self, rank: int, now: float) -> None:
        """``rank`` of the current world sent something at ``now``: known alive once that is
        :data:`LOSS_SETTLE_LEAST` after the first pending loss (a frame that arrives sooner may
        have left before the loss, and its sender may die of the same cause)."""
        if self._since is not None and now >= self._since + LOSS_SETTLE_LEAST:
            self._alive.add(rank)

    def due(self, now: float) -> bool:
        """Whether the settle window of the pending losses is over: its time has passed, or every
        rank not lost is known alive and :data:`LOSS_SETTLE_LEAST` has passed since the first
        loss."""
        if self._settle is None or self._since is None:
            return False
        if now >= self._settle:
            return True
        world = self.world
        if world is None or now < self._since + LOSS_SETTLE_LEAST:
            return False
        return all(r in self._lost or r in self._alive for r in range(world.size))

    def decide(self, scope: SnapshotScope) -> NewWorld | TooFew:
        """The new world after the pending losses (newcomers waiting join it), or the end;
        ``scope``: what the members' copies of the epoch's start hold."""
        world = self.world
        assert world is not None and self._lost, "decide after a loss"
        lost = tuple(self._lost[r] for r in sorted(self._lost))
        survivors = tuple(m for r, m in enumerate(world.members) if r not in self._lost)
        since = self._since if self._since is not None else 0.0
        self._lost.clear()
        self._alive.clear()
        self._settle = self._since = None
        for loss in lost:
            self.drop(loss.member, loss.why)
        joinable = min(len(self.standby), self.max_workers - len(survivors))
        if not survivors or len(survivors) + joinable < self.min_workers:
            return TooFew(lost, len(survivors) + joinable, self.min_workers)
        restore = scope.restore_after([loss.rank for loss in lost])
        return self._next(world, survivors, lost, restore, since)

    def grows(self) -> bool:
        """Whether the world would grow at an epoch boundary now: nobody lost, newcomers waiting,
        and room for one."""
        world = self.world
        return (
            world is not None
            and not self._lost
            and bool(self.standby)
            and world.size < self.max_workers
        )

    def at_boundary(
        self, now: float, scope: SnapshotScope, *, gathered: bool = False
    ) -> NewWorld | None:
        """At an epoch boundary with nobody lost: the world with the newcomers waiting, if any
        fit. Where the members' copies hold the whole state (``scope``), or the members
        ``gathered`` it onto rank 0 at the decision, they keep it and the newcomers receive it
        from rank 0; else every member loads the last checkpoint."""
        world = self.world
        if world is None or not self.grows():
            return None
        restore = Restore.PEERS if gathered else scope.restore_after(())
        return self._next(world, world.members, (), restore, now)

    def _next(
        self,
        world: World,
        survivors: tuple[Member, ...],
        lost: tuple[Loss, ...],
        restore: Restore,
        since: float,
    ) -> NewWorld:
        room = self.max_workers - len(survivors)
        joined = tuple(list(self.standby.values())[:room])
        for member in joined:
            del self.standby[member.peer]
        if joined and restore is Restore.MEMORY:
            restore = Restore.PEERS  # each survivor restores its copy, then rank 0 shares it
        self.world = World(world.generation + 1, survivors + joined)
        self._alive.clear()
        return NewWorld(self.world, world, lost, joined, restore, since)

    # ------------------------------------------------------------------ newcomers, dropped

    def wait(self, member: Member) -> None:
        """``member`` is admitted as a standby until the next boundary."""
        self.standby[member.peer] = member

    def leave(self, peer: bytes) -> Member | None:
        """A standby newcomer left (went silent, failed): forget it."""
        return self.standby.pop(peer, None)

    def has_room(self) -> bool:
        """Whether a newcomer could join at the next boundary."""
        world = self.world
        size = 0 if world is None else world.size - len(self._lost)
        return self.elastic and size + len(self.standby) < self.max_workers

    def why_dropped(self, why: str) -> str:
        """What a process dropped from the run is told (``why``: what it did, "sent nothing for
        3.0 s"), when the change is decided and again if it says hello later."""
        return (
            f"this worker was dropped from the run (it {why}) and the others went on without "
            "it: its process group is gone. Start it again as a new worker once the run admits "
            "newcomers, or leave it stopped"
        )

    def drop(self, member: Member, why: str) -> None:
        """Remember ``member``'s process as dropped: if it comes back, it is refused."""
        hello = member.hello
        self._dropped[(hello.worker_id, hello.host, hello.pid)] = why
        while len(self._dropped) > DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)

    def explain(self, pid: int, why: str) -> None:
        """A pending loss of process ``pid`` (noticed as a closed connection, say) is now known
        to be ``why`` (its exit status): that is what the change will say."""
        for rank, loss in self._lost.items():
            if loss.member.hello.pid == pid:
                self._lost[rank] = Loss(rank, loss.member, why)

    def lost_pid(self, pid: int) -> bool:
        """Whether a process of this pid was lost from the run (pending or decided)."""
        return any(loss.member.hello.pid == pid for loss in self._lost.values()) or any(
            key[2] == pid for key in self._dropped
        )

    def dropped(self, worker_id: str, host: str, pid: int) -> str | None:
        """Why the process that says it is ``worker_id`` on ``host`` with ``pid`` was dropped
        from the run; None when it was not."""
        return self._dropped.get((worker_id, host, pid))
