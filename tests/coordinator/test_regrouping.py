"""An elastic run at the coordinator, on a clock the test sets: a lost rank's peers form a new
world of the next generation and redo the interrupted epoch; too few left end the run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.actions import Action, Broadcast, Journal, RunPhase, Send
from epochal.coordinator.rules.carry import sent_message
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.membership import LOSS_SETTLE, LOSS_SETTLE_LEAST
from epochal.coordinator.rules.watchdog import FAILURE_SETTLE
from epochal.coordinator.serve import resume
from epochal.protocol import (
    Abort,
    Broken,
    Checkpointed,
    Decision,
    EpochReady,
    EpochReport,
    Failed,
    Go,
    Heartbeat,
    Joined,
    OpenStore,
    Regroup,
    Reject,
    StoreReady,
    Welcome,
)
from epochal.rundir.paths import standing
from tests.conftest import FINGERPRINT, hello
from tests.coordinator.test_machine import Run, aborted, broadcast, report, sent

SETTLED = max(LOSS_SETTLE, FAILURE_SETTLE) + 0.01


def elastic(world: int = 4, least: int = 3, **settings: Any) -> Run:
    """A run of ``world`` workers (pid 100 + index) that goes on with ``least``, welcomed and
    training epoch 0."""
    config = CoordinatorConfig(world_size=world, min_workers=least, epochs=5, **settings)
    run = Run(RunMachine(config, resume.inspect(config, None), run_id="r1", now=0.0))
    actions: list[Action] = []
    for i in range(world):
        actions += run.send(0.0, f"w{i}".encode(), hello(f"w{i}", pid=100 + i))
    ((opener, _),) = sent(actions, OpenStore)
    welcome = run.send(0.0, opener, StoreReady(host="127.0.0.1", port=4242, key="k"))
    ranks = {peer: w.rank for peer, w in sent(welcome, Welcome)}
    assert all(w.generation == 0 and w.elastic for _, w in sent(welcome, Welcome))
    run.peers = sorted(ranks, key=ranks.__getitem__)
    go = broadcast(run.all(1.0, lambda r: EpochReady(0, 5, 2)), Go)
    assert go and run.machine.phase is RunPhase.RUNNING
    return run


def regroup(run: Run, now: float, actions: list[Action], generation: int) -> list[Action]:
    """Carry a new world through: its rank 0's store, the welcomes; the members' new order is
    set on ``run``; returns the actions of the last epoch_ready (the Go)."""
    regroups = sent(actions, Regroup)
    ((opener, open_store),) = sent(actions, OpenStore)
    assert open_store.generation == generation
    assert {r.generation for _, r in regroups} == {generation}
    welcome = run.send(now, opener, StoreReady(host="h", port=1, key="k2", generation=generation))
    welcomes = sent(welcome, Welcome)
    assert {w.generation for _, w in welcomes} == {generation}
    ranks = {peer: w.rank for peer, w in welcomes}
    run.peers = sorted(ranks, key=ranks.__getitem__)
    epoch = run.machine.epoch
    return run.all(now, lambda r: EpochReady(epoch, 5, 2, generation=generation))


def test_a_killed_rank_leaves_a_world_of_the_survivors_in_their_order_that_redoes_the_epoch():
    run = elastic()
    before = list(run.peers)
    # epoch 0 decided; epoch 1 under way when worker 2 (pid 102) dies
    run.all(2.0, lambda r: report(1.0, 0))
    assert run.machine.epoch == 1
    run.send(2.5, run.peers[0], dataclasses.replace(report(1.0, 1), generation=0))  # in early
    assert run.machine.process_exited(3.0, 102, "was killed by SIGKILL")
    # the survivors' collectives break: consequences, not failures of their own
    for rank in (1, 3):
        assert run.send(3.01, run.peers[rank], Broken(1, 0, "Connection closed by peer")) == []
    settling = run.machine.on_tick(3.0 + LOSS_SETTLE / 2)
    assert aborted(settling) is None and not sent(settling, Regroup)  # settling
    actions = run.machine.on_tick(3.0 + SETTLED)
    assert aborted(actions) is None
    survivors = [before[0], before[1], before[3]]
    assert [peer for peer, _ in sent(actions, Regroup)] == survivors
    assert sent(actions, Regroup)[0][1] == Regroup(generation=1, epoch=1)
    lines = [a.line for a in actions if hasattr(a, "line")]
    assert any(
        line.startswith(
            "rank 2 (worker w2 (host testhost, pid 102)) was killed by SIGKILL in epoch 1: "
            "continuing with 3 workers from the start of epoch 1"
        )
        for line in lines
    ), lines

    # a report of the broken world arrives late: dropped, not out of step
    assert run.send(3.3, before[3], report(1.0, 1)) == []
    opener = sent(actions, OpenStore)[0][0]
    assert opener == before[0]
    welcome = run.send(3.4, opener, StoreReady(host="h", port=1, key="k2", generation=1))
    welcomes = dict(sent(welcome, Welcome))
    assert [welcomes[p].rank for p in survivors] == [0, 1, 2]
    assert {
        (w.world_size, w.start_epoch, w.restore, w.resume_epoch) for w in welcomes.values()
    } == {(3, 1, "memory", None)}
    run.peers = survivors
    go = run.all(3.5, lambda r: EpochReady(1, 5, 2, generation=1))
    assert broadcast(go, Go) == [Go(epoch=1, train_batches=5, valid_batches=2, lr_factor=1.0)]
    (world,) = [a.record for a in go if isinstance(a, Journal) and a.record["kind"] == "world"]
    assert world["kind"] == "world" and (world["from"], world["to"], world["generation"]) == (
        4,
        3,
        1,
    )
    assert world["epoch"] == 1 and world["seconds"] == pytest.approx(0.5)

    decided = run.all(4.0, lambda r: dataclasses.replace(report(1.0, 1), generation=1))
    (decision,) = broadcast(decided, Decision)
    assert decision.epoch == 1
    (record,) = [a.record for a in decided if isinstance(a, Journal)]
    assert (record["world_size"], record["generation"]) == (3, 1)


def test_rank_0_lost_makes_the_next_survivor_host_the_store():
    run = elastic()
    before = list(run.peers)
    assert run.machine.process_exited(2.0, 100, "exited with status 1")
    actions = run.machine.on_tick(2.0 + SETTLED)
    assert sent(actions, OpenStore)[0][0] == before[1]
    go = regroup(run, 3.0, actions, 1)
    assert broadcast(go, Go)
    assert run.peers == before[1:]


def test_a_failed_rank_is_lost_and_the_others_carry_on():
    run = elastic()
    run.send(2.0, run.peers[3], Failed(reason="CUDA error: an illegal memory access"))
    actions = run.machine.on_tick(2.0 + SETTLED)
    assert aborted(actions) is None and len(sent(actions, Regroup)) == 3


def test_a_silent_rank_is_lost_after_the_heartbeat_timeout():
    run = elastic(heartbeat_timeout=5.0)  # every rank last heard at 1.0
    for t in (3.0, 5.0, 6.5):
        for peer in run.peers[:3]:
            run.send(t, peer, Heartbeat())
    assert aborted(run.machine.on_tick(5.9)) is None
    assert run.machine.membership.lost_ranks() == frozenset()
    assert aborted(run.machine.on_tick(6.6)) is None  # rank 3 silent for 5.6 s
    assert run.machine.membership.lost_ranks() == {3}
    silent = run.peers[3]
    # a loss found by its silence waits until every other rank is heard after it (a rank cut
    # off with it falls silent later, when its own timeout expires)
    assert not sent(run.machine.on_tick(6.6 + SETTLED), Regroup)
    for peer in run.peers[:3]:
        run.send(7.4, peer, Heartbeat())
    actions = run.machine.on_tick(7.4)
    assert aborted(actions) is None
    assert [peer for peer, _ in sent(actions, Regroup)] == run.peers[:3]
    # the silent process may only be frozen: what it reads first when it wakes is why it is out
    ((told, abort),) = sent(actions, Abort)
    assert told == silent
    assert abort.reason.startswith("this worker was dropped from the run (it sent nothing for ")


def test_ranks_cut_off_together_make_one_change_though_their_silences_end_apart():
    """A host of two workers cut off: their last heartbeats came 1.6 s apart (late, on a loaded
    machine), so one's timeout expires 1.6 s after the other's. The first silence holds its
    change open while a rank is unheard since, so the second joins it: one change, 4 -> 2, never
    a world of three that waits for a rank that is gone."""
    run = elastic(world=4, least=2, heartbeat_timeout=5.0)  # heartbeat interval 1 s
    run.send(1.4, run.peers[2], Heartbeat())
    run.send(3.0, run.peers[3], Heartbeat())  # both cut off just after 3.0
    for t in (3.0, 4.0, 5.0, 6.0):
        for peer in run.peers[:2]:
            run.send(t, peer, Heartbeat())
    before = list(run.peers)
    assert aborted(run.machine.on_tick(6.5)) is None
    assert run.machine.membership.lost_ranks() == {2}
    for peer in before[:2]:
        run.send(7.0, peer, Heartbeat())  # known alive
    assert not sent(run.machine.on_tick(7.0), Regroup)  # rank 3 unheard since
    assert not sent(run.machine.on_tick(7.9), Regroup)
    actions = run.machine.on_tick(8.1)  # rank 3 silent for 5.1 s: both lost, the rest heard
    assert [peer for peer, _ in sent(actions, Regroup)] == before[:2]
    assert {peer for peer, _ in sent(actions, Abort)} == set(before[2:])
    lines = [getattr(a, "line", "") for a in actions]
    assert sum("continuing with 2 workers from the start of epoch 0" in x for x in lines) == 2


def test_a_silence_waits_for_the_others_to_be_heard_since():
    run = elastic(heartbeat_timeout=5.0)
    for peer in run.peers[:3]:
        run.send(6.0, peer, Heartbeat())  # then nothing for a while: late heartbeats
    assert aborted(run.machine.on_tick(6.5)) is None
    assert run.machine.membership.lost_ranks() == {3}
    assert not sent(run.machine.on_tick(9.0), Regroup)
    for peer in run.peers[:3]:
        run.send(9.1, peer, Heartbeat())
    assert len(sent(run.machine.on_tick(9.1), Regroup)) == 3


def test_broken_collectives_without_a_lost_rank_abort_with_their_reason():
    run = elastic()
    run.send(2.0, run.peers[1], Broken(0, 0, "RuntimeError: a bug in the loss"))
    actions = run.machine.on_tick(2.0 + SETTLED)
    reason = aborted(actions)
    assert reason is not None and "rank 1" in reason and "a bug in the loss" in reason


def test_two_lost_at_once_make_one_change_and_one_more_below_the_least_ends_the_run():
    run = elastic(world=4, least=2)
    before = list(run.peers)
    run.machine.process_exited(2.0, 101, "was killed by SIGKILL")
    run.machine.process_exited(2.1, 103, "was killed by SIGKILL")
    actions = run.machine.on_tick(2.0 + SETTLED)
    assert [peer for peer, _ in sent(actions, Regroup)] == [before[0], before[2]]
    regroup(run, 3.0, actions, 1)
    run.machine.process_exited(4.0, 102, "exited with status 1")
    actions = run.machine.on_tick(4.0 + SETTLED)
    reason = aborted(actions)
    assert reason is not None
    assert "rank 1 (worker w2 (host testhost, pid 102)) exited with status 1" in reason
    assert "1 worker left, fewer than --min-workers 2" in reason
    assert broadcast(actions, Abort)


def test_a_loss_settles_early_once_every_other_rank_reports_its_broken_collective():
    """Each survivor that reports its broken collective is alive and waiting: once all have, no
    loss of the same moment can still be unnoticed, and the new world forms after the least
    settle time instead of the whole window."""
    run = elastic()
    before = list(run.peers)
    run.all(2.0, lambda r: report(1.0, 0))
    assert run.machine.process_exited(3.0, 102, "was killed by SIGKILL")
    for rank in (0, 1):
        assert run.send(3.01, before[rank], Broken(1, 0, "Connection closed by peer")) == []
    # rank 3 not heard: it may have died with rank 2
    assert not sent(run.machine.on_tick(3.0 + LOSS_SETTLE_LEAST + 0.01), Regroup)
    assert run.send(3.12, before[3], Broken(1, 0, "Connection closed by peer")) == []
    actions = run.machine.on_tick(3.12)
    assert [peer for peer, _ in sent(actions, Regroup)] == [before[0], before[1], before[3]]


def test_every_rank_heard_still_waits_the_least_settle_time():
    """A rank that reported its broken collective can die of the same cause a moment later: its
    loss within the least settle time joins the same change."""
    run = elastic(world=4, least=2)
    before = list(run.peers)
    run.all(2.0, lambda r: report(1.0, 0))
    run.machine.process_exited(3.0, 102, "was killed by SIGKILL")
    for rank in (0, 1, 3):
        run.send(3.005, before[rank], Broken(1, 0, "Connection closed by peer"))
    assert not sent(run.machine.on_tick(3.01), Regroup)
    run.machine.process_exited(3.02, 103, "was killed by SIGKILL")  # rank 3, after its report
    assert not sent(run.machine.on_tick(3.05), Regroup)
    actions = run.machine.on_tick(3.0 + LOSS_SETTLE_LEAST + 0.001)
    assert [peer for peer, _ in sent(actions, Regroup)] == [before[0], before[1]]
    assert len(sent(actions, OpenStore)) == 1  # one new world for both
    assert aborted(run.machine.on_tick(3.0 + SETTLED)) is None


def test_survivors_broken_before_a_second_loss_is_noticed_still_make_one_change():
    """Two killed together, the second exit noticed after the survivors' reports: the dead
    rank never reports, so the window holds until its exit is noticed, and one change names
    both."""
    run = elastic(world=4, least=2)
    before = list(run.peers)
    run.all(2.0, lambda r: report(1.0, 0))
    run.machine.process_exited(3.0, 101, "was killed by SIGKILL")
    for rank in (0, 2):
        run.send(3.01, before[rank], Broken(1, 0, "Connection closed by peer"))
    assert not sent(run.machine.on_tick(3.15), Regroup)  # rank 3 has not reported
    run.machine.process_exited(3.16, 103, "was killed by SIGKILL")
    actions = run.machine.on_tick(3.16)  # now every rank is lost or reported: at once
    assert [peer for peer, _ in sent(actions, Regroup)] == [before[0], before[2]]
    lines = [a.line for a in actions if hasattr(a, "line")]
    assert [line.split(" (")[0] for line in lines if "continuing with 2" in line] == [
        "rank 1",
        "rank 3",
    ], lines
    assert len(sent(actions, OpenStore)) == 1  # one new world


def test_a_broken_collective_of_an_older_world_does_not_count_as_heard():
    run = elastic(world=4, least=2)
    run.all(2.0, lambda r: report(1.0, 0))
    run.machine.process_exited(3.0, 103, "was killed by SIGKILL")
    regroup(run, 4.0, run.machine.on_tick(3.0 + SETTLED), 1)  # world 1: w0, w1, w2
    survivors = list(run.peers)
    run.machine.process_exited(5.0, 102, "was killed by SIGKILL")  # rank 2 of world 1
    for peer in survivors[:2]:  # late reports of world 0 would close the window; not these
        run.send(5.01, peer, Broken(1, 0, "Connection closed by peer"))
    assert not sent(run.machine.on_tick(5.0 + LOSS_SETTLE_LEAST + 0.05), Regroup)
    for peer in survivors[:2]:
        run.send(5.2, peer, Broken(1, 1, "Connection closed by peer"))
    assert [p for p, _ in sent(run.machine.on_tick(5.2), Regroup)] == survivors[:2]


def test_a_dropped_process_that_comes_back_is_refused_naming_why():
    run = elastic()
    stopped = run.peers[2]
    run.machine.lose(2.0, 2, "sent nothing for 15.0 s")
    regroup(run, 3.0, run.machine.on_tick(2.0 + SETTLED), 1)
    # it wakes: its frames are a stranger's, and its hello again is refused
    assert sent(run.send(4.0, stopped, report(1.0, 1)), Reject)
    refusal = sent(run.send(4.1, stopped, hello("w2", pid=102)), Reject)
    assert refusal and "dropped from the run (it sent nothing for 15.0 s)" in refusal[0][1].reason
    assert run.machine.phase is RunPhase.RUNNING and len(run.machine.members) == 3


def test_without_min_workers_a_lost_worker_is_a_failure_as_before():
    config = CoordinatorConfig(world_size=2, epochs=3)
    assert not config.elastic
    run = Run(RunMachine(config, resume.inspect(config, None), run_id="r1", now=0.0))
    for i in range(2):
        run.send(0.0, f"w{i}".encode(), hello(f"w{i}", pid=100 + i))
    assert run.machine.process_exited(1.0, 101, "was killed by SIGKILL") is False


def journal(actions: list[Action], kind: str) -> list[dict[str, Any]]:
    return [
        a.record
        for a in actions
        if isinstance(a, Journal) and a.kind == "epoch" and a.record.get("kind") == kind
    ]


def lose_rank_3(run: Run) -> list[bytes]:
    """Rank 3 (pid 103) is lost in epoch 0; the survivors' world of 3 redoes it. Its peers."""
    before = list(run.peers)
    run.machine.process_exited(2.0, 103, "was killed by SIGKILL")
    go = regroup(run, 3.0, run.machine.on_tick(2.0 + SETTLED), 1)
    assert broadcast(go, Go) and run.peers == before[:3]
    return before


def test_a_newcomer_waits_as_a_standby_and_joins_at_the_next_epoch_boundary():
    run = elastic()
    survivors = lose_rank_3(run)[:3]
    # a replacement says hello while epoch 0 is redone at three: it waits, heartbeating
    waiting = run.send(4.0, b"w9", hello("w9", pid=109))
    assert sent(waiting, Joined) and not sent(waiting, Welcome)
    assert any("is waiting to join the run" in getattr(a, "line", "") for a in waiting)
    assert run.send(4.5, b"w9", Heartbeat()) == []
    # the epoch is decided (its decision carries the next Go, as ever), then the world grows:
    # the next epoch begins again in it
    actions = run.all(5.0, lambda r: dataclasses.replace(report(1.0, 0), generation=1))
    (decision,) = broadcast(actions, Decision)
    assert decision.epoch == 0 and decision.go is not None and not decision.stop
    assert actions.index(next(a for a in actions if isinstance(a, Send))) > actions.index(
        next(a for a in actions if isinstance(a, Broadcast))
    )  # the regroups follow the decision
    regroups = sent(actions, Regroup)
    assert [peer for peer, _ in regroups] == survivors  # the newcomer is not in a group yet
    assert {r for _, r in regroups} == {Regroup(generation=2, epoch=1)}
    assert any("joins: 4 workers from epoch 1" in getattr(a, "line", "") for a in actions)
    assert run.machine.phase is RunPhase.STORE and run.machine.epoch == 1
    # an epoch_ready of the old world, sent before the regroup arrived, is dropped
    assert run.send(5.1, survivors[1], EpochReady(1, 5, 2, generation=1)) == []

    ((opener, _),) = sent(actions, OpenStore)
    assert opener == survivors[0]  # rank 0 keeps its rank and hosts the new store
    welcome = run.send(5.2, opener, StoreReady(host="h", port=2, key="k3", generation=2))
    welcomes = dict(sent(welcome, Welcome))
    assert [welcomes[p].rank for p in [*survivors, b"w9"]] == [0, 1, 2, 3]
    assert {w.world_size for w in welcomes.values()} == {4}
    assert {w.restore for w in welcomes.values()} == {"peers"}  # rank 0's state to everyone
    assert {w.start_epoch for w in welcomes.values()} == {1}
    run.peers = [*survivors, b"w9"]
    go = run.all(6.0, lambda r: EpochReady(1, 5, 2, generation=2))
    assert broadcast(go, Go)[0].epoch == 1
    (world,) = journal(go, "world")
    assert (world["epoch"], world["from"], world["to"], world["lost"]) == (1, 3, 4, [])
    assert world["joined"] == ["w9"] and world["generation"] == 2
    assert any("4 workers train epoch 1" in getattr(a, "line", "") for a in go)
    # the epoch at four is journaled at four
    decided = run.all(7.0, lambda r: dataclasses.replace(report(1.0, 1), generation=2))
    (record,) = journal(decided, "epoch")
    assert (record["world_size"], record["generation"]) == (4, 2)


def test_newcomers_past_the_most_workers_are_refused():
    run = elastic()
    refused = sent(run.send(2.0, b"w9", hello("w9", pid=109)), Reject)
    assert refused and "the most --world-size admits" in refused[0][1].reason
    lose_rank_3(run)
    assert sent(run.send(4.0, b"w9", hello("w9", pid=109)), Joined)  # room for one
    refused = sent(run.send(4.1, b"w10", hello("w10", pid=110)), Reject)
    assert refused and "the most --world-size admits" in refused[0][1].reason
    assert list(run.machine.membership.standby) == [b"w9"]


def test_a_newcomer_with_another_model_is_refused_and_the_run_goes_on():
    run = elastic()
    lose_rank_3(run)
    other = dataclasses.replace(FINGERPRINT, digest="b" * 64)
    refused = sent(run.send(4.0, b"w9", hello("w9", fingerprint=other, pid=109)), Reject)
    assert refused and "its model differs from the run's" in refused[0][1].reason
    assert run.machine.phase is RunPhase.RUNNING and not run.machine.over
    assert not run.machine.membership.standby


def test_a_standby_that_goes_silent_is_forgotten():
    run = elastic(heartbeat_timeout=5.0)
    lose_rank_3(run)
    run.send(4.0, b"w9", hello("w9", pid=109))
    for t in (6.0, 8.0, 9.5):
        for peer in run.peers:
            run.send(t, peer, Heartbeat())
    actions = run.machine.on_tick(9.6)
    assert any("w9" in getattr(a, "line", "") and "went silent" in a.line for a in actions)
    assert aborted(actions) is None and not run.machine.membership.standby
    decided = run.all(10.0, lambda r: dataclasses.replace(report(1.0, 0), generation=1))
    assert broadcast(decided, Decision)[0].go is not None  # nobody waits: no world change


# ---------------------------------------------------------------- worlds restored from a checkpoint


def shard_report(valid_sum: float, epoch: int, generation: int = 0) -> EpochReport:
    """A report whose ready says the rank's copies are shards (mode sharded, fully_sharded)."""
    base = report(valid_sum, epoch)
    assert base.ready is not None
    ready = dataclasses.replace(base.ready, generation=generation, snapshots="shard")
    return dataclasses.replace(base, ready=ready, generation=generation)


def test_shards_lost_restore_the_last_checkpoint_and_the_epochs_after_it_are_done_again():
    run = elastic(checkpoint_dir=Path("/nowhere"), checkpoint_every=3)
    before = list(run.peers)
    records: list[dict[str, Any]] = []
    records += journal(run.all(2.0, lambda r: shard_report(10.0, 0)), "epoch")  # best: saved
    records += journal(run.send(2.1, before[0], Checkpointed(epoch=0)), "checkpoint")
    records += journal(run.all(3.0, lambda r: shard_report(12.0, 1)), "epoch")  # worse: not
    assert run.machine.epoch == 2 and run.machine._loop.best_epoch == 0
    assert run.machine.process_exited(4.0, 102, "was killed by SIGKILL")
    actions = run.machine.on_tick(4.0 + SETTLED)
    assert aborted(actions) is None
    lines = [getattr(a, "line", "") for a in actions]
    assert any(
        "was killed by SIGKILL in epoch 2: continuing with 3 workers from the checkpoint of "
        "epoch 0" in line
        for line in lines
    ), lines
    # the decisions since the checkpoint are undone: epoch 1 is the next, its state rewound
    assert {r for _, r in sent(actions, Regroup)} == {Regroup(generation=1, epoch=1)}
    assert run.machine.epoch == 1
    assert [o.epoch for o in run.machine._loop.history] == [0]
    ((opener, _),) = sent(actions, OpenStore)
    welcome = run.send(4.5, opener, StoreReady(host="h", port=1, key="k2", generation=1))
    welcomes = [w for _, w in sent(welcome, Welcome)]
    assert {(w.world_size, w.start_epoch, w.restore, w.resume_epoch) for w in welcomes} == {
        (3, 1, "checkpoint", 0)
    }
    run.peers = [before[0], before[1], before[3]]
    go = run.all(5.0, lambda r: EpochReady(1, 5, 2, generation=1, snapshots="shard"))
    assert broadcast(go, Go)[0].epoch == 1
    (world,) = journal(go, "world")
    assert (world["epoch"], world["restore"], world["checkpoint"]) == (1, "checkpoint", 0)
    records += [world]
    again = run.all(6.0, lambda r: shard_report(11.0, 1, generation=1))
    (decision,) = broadcast(again, Decision)
    assert decision.epoch == 1 and decision.is_best is False
    records += journal(again, "epoch")
    # what the journal's reader keeps: epoch 1 once, as done again by the world of three
    kept = standing(records)
    assert [(r["kind"], r["epoch"], r.get("world_size")) for r in kept] == [
        ("epoch", 0, 4),
        ("checkpoint", 0, None),
        ("world", 1, None),
        ("epoch", 1, 3),
    ]


def test_shards_lost_before_any_checkpoint_end_the_run_saying_why():
    run = elastic(checkpoint_dir=Path("/nowhere"), checkpoint_every=3)
    run.all(2.0, lambda r: shard_report(10.0, 0))  # decided, its checkpoint not committed yet
    run.machine.process_exited(3.0, 101, "was killed by SIGKILL")
    reason = aborted(run.machine.on_tick(3.0 + SETTLED))
    assert reason is not None
    assert "rank 1 (worker w1 (host testhost, pid 101)) was killed by SIGKILL in epoch 1" in reason
    assert "no checkpoint is committed yet to restore from" in reason


def test_a_world_of_shards_grows_once_the_checkpoint_of_the_boundary_is_committed():
    run = elastic(checkpoint_dir=Path("/nowhere"))
    before = list(run.peers)
    run.all(2.0, lambda r: shard_report(10.0, 0))
    run.send(2.1, before[0], Checkpointed(epoch=0))
    run.machine.process_exited(2.5, 103, "was killed by SIGKILL")
    go = regroup(run, 3.0, run.machine.on_tick(2.5 + SETTLED), 1)
    assert broadcast(go, Go)[0].epoch == 1  # from the checkpoint of epoch 0: nothing undone
    waiting = run.send(3.5, b"w9", hello("w9", pid=109))
    assert sent(waiting, Joined)
    # epoch 1 decided: the newcomer cannot take a shard of a state nobody holds whole, so the
    # world waits for the checkpoint of epoch 1 (epoch 2 starts meanwhile)
    decided = run.all(4.0, lambda r: shard_report(9.0, 1, generation=1))
    assert broadcast(decided, Decision) and not sent(decided, Regroup)
    grown = run.send(4.2, run.peers[0], Checkpointed(epoch=1))
    assert {r for _, r in sent(grown, Regroup)} == {Regroup(generation=2, epoch=2)}
    assert any(
        "joins: 4 workers from epoch 2 (the checkpoint of epoch 1)" in getattr(a, "line", "")
        for a in grown
    )
    ((opener, _),) = sent(grown, OpenStore)
    welcome = run.send(4.5, opener, StoreReady(host="h", port=2, key="k3", generation=2))
    welcomes = dict(sent(welcome, Welcome))
    assert welcomes[b"w9"].rank == 3
    assert {(w.restore, w.resume_epoch, w.start_epoch) for w in welcomes.values()} == {
        ("checkpoint", 1, 2)
    }


def gathering_report(valid_sum: float, epoch: int, generation: int = 0) -> EpochReport:
    """A shard report whose ready says the rank gathers its part for newcomers (epochal.train)."""
    base = shard_report(valid_sum, epoch, generation)
    assert base.ready is not None
    return dataclasses.replace(base, ready=dataclasses.replace(base.ready, gathers=True))


def shards_at_three_with_a_standby(run: Run) -> list[bytes]:
    """Epoch 0 decided and checkpointed; rank 3 lost, its shard restored from the checkpoint by a
    world of three that trains epoch 1; a newcomer waits. The members' peers."""
    before = list(run.peers)
    run.all(2.0, lambda r: gathering_report(10.0, 0))
    run.send(2.1, before[0], Checkpointed(epoch=0))
    run.machine.process_exited(2.5, 103, "was killed by SIGKILL")
    go = regroup(run, 3.0, run.machine.on_tick(2.5 + SETTLED), 1)
    assert broadcast(go, Go)[0].epoch == 1
    assert sent(run.send(3.5, b"w9", hello("w9", pid=109)), Joined)
    return before[:3]


def test_a_world_of_shards_grows_at_the_boundary_from_the_state_its_members_gather():
    run = elastic(checkpoint_dir=Path("/nowhere"))
    members = shards_at_three_with_a_standby(run)
    # epoch 1 decided: no go, but every member gathers its part onto rank 0 and says ready
    decided = run.all(4.0, lambda r: gathering_report(9.0, 1, generation=1))
    (decision,) = broadcast(decided, Decision)
    assert decision.gather and decision.go is None and decision.checkpoint
    assert not sent(decided, Regroup)
    assert run.machine.phase is RunPhase.READY and run.machine.epoch == 2
    (record,) = journal(decided, "epoch")
    assert sent_message(record["next"]["sent"]) == decision  # a restart resends it
    # the checkpoint the decision asked for is committed, and is not what the world grows from
    assert not sent(run.send(4.1, members[0], Checkpointed(epoch=1)), Regroup)
    ready = EpochReady(2, 5, 2, generation=1, snapshots="shard", gathers=True)
    grown = run.all(4.5, lambda r: ready)
    assert not broadcast(grown, Go)
    assert [peer for peer, _ in sent(grown, Regroup)] == members
    assert {r for _, r in sent(grown, Regroup)} == {Regroup(generation=2, epoch=2)}
    lines = [getattr(a, "line", "") for a in grown]
    assert any(
        "joins: 4 workers from epoch 2 (the state sent from rank 0 over the data plane)" in line
        for line in lines
    ), lines
    ((opener, _),) = sent(grown, OpenStore)
    assert opener == members[0]  # rank 0 holds what was gathered, and keeps its rank
    welcome = run.send(4.6, opener, StoreReady(host="h", port=2, key="k3", generation=2))
    welcomes = dict(sent(welcome, Welcome))
    assert [welcomes[p].rank for p in [*members, b"w9"]] == [0, 1, 2, 3]
    assert {(w.restore, w.resume_epoch, w.start_epoch) for w in welcomes.values()} == {
        ("peers", None, 2)
    }
    run.peers = [*members, b"w9"]
    go = run.all(5.0, lambda r: EpochReady(2, 5, 2, generation=2, snapshots="shard", gathers=True))
    assert broadcast(go, Go)[0].epoch == 2
    (world,) = journal(go, "world")
    assert (world["epoch"], world["from"], world["to"], world["restore"]) == (2, 3, 4, "peers")
    assert "checkpoint" not in world and world["joined"] == ["w9"]


def test_a_newcomer_after_the_decision_waits_for_the_next_gather_not_the_checkpoint():
    """A newcomer that says hello between a decision (which could not gather for it) and the
    commit of that decision's checkpoint is not grown from the checkpoint when the members
    gather: the next decision gathers for it, and it takes the state from rank 0."""
    run = elastic(checkpoint_dir=Path("/nowhere"))
    before = list(run.peers)
    run.all(2.0, lambda r: gathering_report(10.0, 0))
    run.send(2.1, before[0], Checkpointed(epoch=0))
    run.machine.process_exited(2.5, 103, "was killed by SIGKILL")
    regroup(run, 3.0, run.machine.on_tick(2.5 + SETTLED), 1)
    members = list(run.peers)
    decided = run.all(4.0, lambda r: gathering_report(9.0, 1, generation=1))
    (decision,) = broadcast(decided, Decision)
    assert not decision.gather and decision.go is not None  # nobody was waiting yet
    assert sent(run.send(4.1, b"w9", hello("w9", pid=109)), Joined)
    assert not sent(run.send(4.2, members[0], Checkpointed(epoch=1)), Regroup)
    assert run.machine.generation == 1 and run.machine.phase is RunPhase.RUNNING
    (decision,) = broadcast(run.all(5.0, lambda r: gathering_report(8.0, 2, 1)), Decision)
    assert decision.gather and decision.go is None
    ready = EpochReady(3, 5, 2, generation=1, snapshots="shard", gathers=True)
    grown = run.all(5.5, lambda r: ready)
    assert [peer for peer, _ in sent(grown, Regroup)] == members
    ((opener, _),) = sent(grown, OpenStore)
    welcome = run.send(5.6, opener, StoreReady(host="h", port=2, key="k3", generation=2))
    welcomes = dict(sent(welcome, Welcome))
    assert {(w.restore, w.resume_epoch, w.start_epoch) for w in welcomes.values()} == {
        ("peers", None, 3)
    }


def test_members_that_cannot_all_gather_grow_from_the_checkpoint():
    run = elastic(checkpoint_dir=Path("/nowhere"))
    shards_at_three_with_a_standby(run)
    # rank 0's training code has no gather hook (or is one minor version older)
    mixed = run.all(4.0, lambda r: gathering_report(9.0, 1, 1) if r else shard_report(9.0, 1, 1))
    (decision,) = broadcast(mixed, Decision)
    assert not decision.gather and decision.go is not None
    grown = run.send(4.2, run.peers[0], Checkpointed(epoch=1))
    assert {r for _, r in sent(grown, Regroup)} == {Regroup(generation=2, epoch=2)}


def test_a_standby_gone_before_the_gathered_readies_leaves_the_world_as_it_is():
    run = elastic(checkpoint_dir=Path("/nowhere"))
    members = shards_at_three_with_a_standby(run)
    decided = run.all(4.0, lambda r: gathering_report(9.0, 1, generation=1))
    assert broadcast(decided, Decision)[0].gather
    run.machine.membership.leave(b"w9")  # the newcomer went silent before the readies
    ready = EpochReady(2, 5, 2, generation=1, snapshots="shard", gathers=True)
    go = run.all(4.5, lambda r: ready)
    assert broadcast(go, Go)[0].epoch == 2 and not sent(go, Regroup)
    assert run.machine.phase is RunPhase.RUNNING and run.machine.generation == 1
    assert members == run.peers


def test_a_rank_lost_while_the_members_gather_makes_the_one_change_with_the_newcomer():
    run = elastic(checkpoint_dir=Path("/nowhere"))
    members = shards_at_three_with_a_standby(run)
    assert broadcast(run.all(4.0, lambda r: gathering_report(9.0, 1, 1)), Decision)[0].gather
    run.send(4.1, members[0], Checkpointed(epoch=1))
    run.machine.process_exited(4.2, 101, "was killed by SIGKILL")
    changed = run.machine.on_tick(4.2 + SETTLED)
    assert aborted(changed) is None
    lines = [getattr(a, "line", "") for a in changed]
    assert any("continuing with 3 workers from the checkpoint of epoch 1" in x for x in lines)
    go = regroup(run, 5.0, changed, 2)
    assert broadcast(go, Go)[0].epoch == 2  # the readies start the epoch: no second change
    assert run.peers == [members[0], members[2], b"w9"]
    assert run.machine.generation == 2 and run.machine._gathering is None
