"""The membership rules on a given clock: losses settled into one new world, the survivors'
order kept, too few left ends the run, newcomers admitted at a boundary, the dropped refused."""

from __future__ import annotations

import pytest

from epochal.coordinator.rules.membership import (
    LOSS_SETTLE,
    Membership,
    NewWorld,
    Restore,
    TooFew,
)
from epochal.coordinator.rules.rendezvous import Member
from epochal.protocol import Fingerprint, SnapshotScope
from tests.conftest import hello

FP = Fingerprint(digest="a" * 64, torch_version="2.13.0", entries=1)


def member(i: int, pid: int | None = None) -> Member:
    said = hello(f"w{i}", FP, host="node", pid=1000 + i if pid is None else pid)
    return Member(peer=f"w{i}".encode(), hello=said)


def formed(n: int, least: int) -> Membership:
    membership = Membership(least, n)
    membership.form(tuple(member(i) for i in range(n)))
    return membership


def test_a_loss_is_decided_after_the_settle_window_keeping_the_survivors_order():
    m = formed(4, 3)
    assert m.lose(10.0, 1, "was killed by SIGKILL")
    assert not m.due(10.0 + LOSS_SETTLE / 2)
    assert m.due(10.0 + LOSS_SETTLE)
    decided = m.decide(SnapshotScope.WHOLE)
    assert isinstance(decided, NewWorld)
    assert [x.peer for x in decided.world.members] == [b"w0", b"w2", b"w3"]
    assert decided.world.generation == 1 and decided.previous.generation == 0
    assert decided.restore is Restore.MEMORY and decided.since == 10.0
    assert [loss.rank for loss in decided.lost] == [1]
    assert decided.summary() == "4 -> 3 workers (lost rank 1), generation 1"
    assert m.world is decided.world and not m.losing


def test_losses_within_the_window_make_one_change_and_a_repeat_counts_once():
    m = formed(4, 2)
    assert m.lose(0.0, 3, "exited")
    assert not m.lose(0.1, 3, "failed: connection closed")  # its consequence, said again
    assert m.lose(0.2, 0, "was silent for 15 s")
    decided = m.decide(SnapshotScope.WHOLE)
    assert isinstance(decided, NewWorld)
    assert [x.peer for x in decided.world.members] == [b"w1", b"w2"]
    assert [loss.rank for loss in decided.lost] == [0, 3]


def test_fewer_than_the_least_left_ends_the_run_naming_every_rank_lost():
    m = formed(4, 3)
    m.lose(0.0, 1, "was killed by SIGKILL")
    m.lose(0.1, 2, "was killed by SIGKILL")
    decided = m.decide(SnapshotScope.WHOLE)
    assert isinstance(decided, TooFew)
    reason = decided.reason()
    assert "rank 1 (worker w1" in reason and "rank 2 (worker w2" in reason
    assert "2 workers left, fewer than --min-workers 3" in reason


def test_a_run_that_is_not_elastic_ends_at_its_first_loss():
    m = formed(2, 2)
    assert not m.elastic
    m.lose(0.0, 0, "exited")
    assert isinstance(m.decide(SnapshotScope.WHOLE), TooFew)


@pytest.mark.parametrize(
    ("scope", "lost", "restore"),
    [
        (SnapshotScope.WHOLE, [0], Restore.MEMORY),
        (SnapshotScope.WHOLE, [1, 2], Restore.MEMORY),
        (SnapshotScope.ROOT, [2], Restore.MEMORY),
        (SnapshotScope.ROOT, [0], Restore.CHECKPOINT),  # rank 0 held the optimizer alone
        (SnapshotScope.SHARD, [1], Restore.CHECKPOINT),  # a shard went with it
        (SnapshotScope.OFF, [1], Restore.CHECKPOINT),  # no copies kept
    ],
)
def test_the_restore_follows_what_the_copies_hold_and_who_was_lost(scope, lost, restore):
    m = formed(4, 1)
    for rank in lost:
        m.lose(0.0, rank, "exited")
    decided = m.decide(scope)
    assert isinstance(decided, NewWorld)
    assert decided.restore is restore


@pytest.mark.parametrize(
    ("scope", "restore"),
    [
        (SnapshotScope.WHOLE, Restore.PEERS),
        (SnapshotScope.ROOT, Restore.PEERS),
        (SnapshotScope.SHARD, Restore.CHECKPOINT),  # no rank's copy is the whole state
        (SnapshotScope.OFF, Restore.CHECKPOINT),
    ],
)
def test_a_world_grows_from_its_peers_only_where_copies_hold_the_whole_state(scope, restore):
    m = formed(4, 2)
    m.lose(0.0, 3, "exited")
    m.decide(SnapshotScope.WHOLE)
    m.wait(member(7))
    decided = m.at_boundary(5.0, scope)
    assert decided is not None and decided.restore is restore
    assert [x.hello.worker_id for x in decided.joined] == ["w7"]


def test_a_loss_and_a_newcomer_together_restore_the_survivors_and_share_rank_0s_state():
    m = formed(4, 2)
    m.lose(0.0, 3, "exited")
    m.decide(SnapshotScope.WHOLE)
    m.wait(member(7))
    m.lose(1.0, 1, "exited")
    decided = m.decide(SnapshotScope.WHOLE)
    assert isinstance(decided, NewWorld) and decided.restore is Restore.PEERS
    assert decided.world.size == 3 and len(decided.joined) == 1


def test_newcomers_wait_for_a_boundary_up_to_the_most_workers():
    m = formed(4, 2)
    m.lose(0.0, 2, "exited")
    m.decide(SnapshotScope.WHOLE)  # 3 left
    assert m.has_room()
    m.wait(member(7))
    assert not m.has_room()  # 3 + 1 waiting = 4
    decided = m.at_boundary(5.0, SnapshotScope.WHOLE)
    assert isinstance(decided, NewWorld) and decided.restore is Restore.PEERS
    assert [x.peer for x in decided.world.members] == [b"w0", b"w1", b"w3", b"w7"]
    assert decided.joined == (member(7),) and decided.world.generation == 2
    assert m.at_boundary(6.0, SnapshotScope.WHOLE) is None  # nobody waits any more


def test_a_newcomer_waiting_joins_the_world_a_loss_makes():
    m = formed(3, 2)
    m.lose(0.0, 0, "exited")
    m.decide(SnapshotScope.WHOLE)
    m.wait(member(9))
    m.lose(1.0, 1, "exited")
    decided = m.decide(SnapshotScope.WHOLE)
    assert isinstance(decided, NewWorld)
    # one survivor and the newcomer make the least: the newcomer counts, after the survivors
    assert [x.peer for x in decided.world.members] == [b"w1", b"w9"]


def test_a_dropped_process_is_refused_but_a_new_process_with_its_id_is_not():
    m = formed(3, 2)
    m.lose(0.0, 1, "was silent for 15 s")
    m.decide(SnapshotScope.WHOLE)
    assert m.dropped("w1", "node", 1001) == "was silent for 15 s"
    assert m.dropped("w1", "node", 4242) is None  # restarted: another pid
    assert m.dropped("w0", "node", 1000) is None
