"""The replica check: ranks that should hold the same weights are compared after every epoch."""

from __future__ import annotations

import dataclasses

import pytest

from epochal.coordinator.rules.actions import Journal
from epochal.coordinator.rules.replicas import replicas_differ
from epochal.protocol import Abort, Decision
from tests.coordinator.test_machine import aborted, broadcast, ready, report, start


def test_equal_checksums_or_none_at_all_agree():
    assert replicas_differ(0, {0: 7, 1: 7, 2: 7}) is None
    assert replicas_differ(0, {0: None, 1: None}) is None  # fully sharded: nothing to compare
    assert replicas_differ(0, {0: 7, 1: None, 2: 7}) is None


def test_differing_checksums_name_the_ranks_and_the_fix():
    reason = replicas_differ(3, {0: 5, 1: 9, 2: 5, 3: 5})
    assert reason is not None
    assert reason.startswith(
        "after epoch 3 the ranks' weights differ (ranks 0,2-3 hold one; rank 1 holds another)"
    )
    assert "DistributedDataParallel" in reason and "--no-replica-check" in reason


def test_many_sets_of_weights_are_cut_short():
    reason = replicas_differ(0, {rank: rank for rank in range(100)})
    assert reason is not None and "96 more sets of ranks hold others" in reason
    assert len(reason) < 600


def checked(rank: int, epoch: int, checksum: int | None):
    return dataclasses.replace(report(1.0, epoch), checksum=checksum)


@pytest.mark.parametrize("check", [True, False])
def test_the_welcome_says_whether_to_send_checksums(check: bool):
    run = start(replica_check=check)
    welcomes = [run.machine._welcome_for(peer) for peer in run.peers]
    assert welcomes and all(w.replica_check is check for w in welcomes)


def test_ranks_whose_weights_differ_abort_the_run_before_the_epoch_is_decided():
    run = start(epochs=3)
    run.all(1.0, ready)
    actions = run.all(2.0, lambda rank: checked(rank, 0, 100 + rank))
    reason = aborted(actions)
    assert reason is not None and "rank 0 holds one; rank 1 holds another" in reason
    assert broadcast(actions, Decision) == []
    (abort,) = broadcast(actions, Abort)
    assert "after epoch 0 the ranks' weights differ" in abort.reason
    assert [a.kind for a in actions if isinstance(a, Journal)] == ["result"]  # no epoch


def test_equal_weights_carry_on_and_the_check_can_be_turned_off():
    run = start(epochs=3)
    run.all(1.0, ready)
    actions = run.all(2.0, lambda rank: checked(rank, 0, 42))
    assert aborted(actions) is None and len(broadcast(actions, Decision)) == 1

    off = start(epochs=3, replica_check=False)
    off.all(1.0, ready)
    actions = off.all(2.0, lambda rank: checked(rank, 0, 100 + rank))
    assert aborted(actions) is None and len(broadcast(actions, Decision)) == 1
