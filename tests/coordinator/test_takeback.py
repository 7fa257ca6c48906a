"""A restarted coordinator takes the running workers back where its journal left them.

The first coordinator is played to the instant it dies (its journal written from its own
actions); the second reads that journal back through :func:`resume.inspect` and is played against
workers saying hello again, on a clock the test sets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any

from epochal.coordinator import CoordinatorConfig
from epochal.coordinator.rules.actions import Action, Finished, Journal, RunPhase
from epochal.coordinator.rules.carry import sent_record
from epochal.coordinator.rules.machine import TAKING_BACK, RunMachine
from epochal.coordinator.serve import resume
from epochal.errors import RunAborted
from epochal.protocol import (
    Checkpointed,
    Decision,
    Done,
    Finish,
    Go,
    Heartbeat,
    Joined,
    Reject,
    Welcome,
)
from tests.conftest import hello
from tests.coordinator.conftest import serve
from tests.coordinator.test_machine import (
    Run,
    aborted,
    broadcast,
    logged,
    ready,
    report,
    sent,
    start,
)

EPOCHS = 4


def journaled(actions: list[Action]) -> list[dict[str, Any]]:
    return [a.record for a in actions if isinstance(a, Journal) and a.kind == "epoch"]


def first_run(
    run_dir: Path, decided: int, **settings: Any
) -> tuple[CoordinatorConfig, list[Decision]]:
    """A run of 2 workers played through the decision of epoch ``decided``, its journal and
    run.json written as the service would; the decisions it sent."""
    run = start(**{"epochs": EPOCHS, "run_dir": run_dir, **settings})
    config = run.machine.config
    actions = run.all(1.0, ready)
    decisions = []
    for epoch in range(decided + 1):
        decided_now = run.all(2.0 + epoch, lambda r, e=epoch: report(1.0 + r + e, e))
        decisions += broadcast(decided_now, Decision)
        actions += decided_now
    run_dir.mkdir(exist_ok=True)
    (run_dir / "run.json").write_text(
        json.dumps({"run_id": "r1", "config": resume.config_record(config)})
    )
    with (run_dir / "epochs.jsonl").open("w") as journal:
        for record in journaled(actions):
            journal.write(json.dumps(record) + "\n")
    return config, decisions


def restarted(config: CoordinatorConfig, now: float = 100.0) -> Run:
    state = resume.inspect(config, None)
    assert state.carry is not None
    return Run(RunMachine(config, state, run_id="r2", now=now))


def back(rank: int) -> Any:
    return hello(f"w{rank}", rank_hint=rank, run_id="r1", pid=100 + rank)


def reference_decision(tmp_path: Path, epoch: int) -> Decision:
    """The decision of ``epoch`` by a coordinator that never stopped, on the same reports."""
    reference = start(epochs=EPOCHS, run_dir=tmp_path / "reference")
    reference.all(1.0, ready)
    for e in range(epoch + 1):
        actions = reference.all(2.0 + e, lambda r, e=e: report(1.0 + r + e, e))
    (decision,) = broadcast(actions, Decision)
    return decision


def test_a_rank_that_missed_the_last_decision_gets_the_journaled_one_and_nothing_is_redone(
    tmp_path,
):
    config, decisions = first_run(tmp_path / "run", decided=1)
    # the first coordinator died after sending decision 1 to rank 0 alone: rank 1 still waits
    # for it, rank 0 trains epoch 2 (blocked in a collective with rank 1) and comes back later
    run = restarted(config)
    welcomed = run.send(100.0, b"n1", back(1))
    ((peer, welcome),) = sent(welcomed, Welcome)
    assert peer == b"n1" and welcome.carry_on
    assert (welcome.rank, welcome.world_size, welcome.start_epoch) == (1, 2, 2)
    assert welcome.resume_epoch is None and welcome.run_id == "r2"
    assert any(
        "taking its 2 workers back where they are (epoch 2)" in line for line in logged(welcomed)
    )

    again = run.send(100.5, b"n1", report(3.0, 1))  # its report of epoch 1, sent again
    assert sent(again, Decision) == [(b"n1", decisions[1])]  # exactly what rank 0 got
    assert journaled(again) == []  # nothing decided again
    assert "rank 1 (worker w1 (host testhost, pid 101)) is back (1 of 2)" in logged(again)

    assert run.send(110.0, b"n1", report(4.0, 2)) == []  # epoch 2 trained: kept
    welcomed = run.send(111.0, b"n0", back(0))
    assert [m.carry_on for _, m in sent(welcomed, Welcome)] == [True]
    assert run.machine.taking_back  # welcomed, but not back before it says where it is
    decided = run.send(111.5, b"n0", report(3.0, 2))  # its report of epoch 2, sent again
    assert any(
        "every worker is back (2); the run carries on in epoch 2" in line
        for line in logged(decided)
    )
    (decision,) = broadcast(decided, Decision)
    assert decision == reference_decision(tmp_path, 2)  # as if the coordinator never stopped
    (record,) = journaled(decided)
    assert record["epoch"] == 2 and record["world_size"] == 2


def test_when_no_rank_got_the_decision_each_gets_it_and_the_last_one_back_too(tmp_path):
    # killed after the decision's record was written, before any rank heard it: the last rank to
    # come back asks for it after its hello, and must get it, not an abort
    config, decisions = first_run(tmp_path / "run", decided=1)
    run = restarted(config)
    run.send(100.0, b"n0", back(0))
    run.send(100.1, b"n1", back(1))  # both welcomed; neither has said where it is yet
    first = run.send(100.2, b"n1", report(3.0, 1))
    last = run.send(100.3, b"n0", report(2.0, 1))
    assert aborted(first + last) is None
    assert sent(first, Decision) == [(b"n1", decisions[1])]
    assert sent(last, Decision) == [(b"n0", decisions[1])]
    assert not run.machine.taking_back
    run.send(101.0, b"n0", report(3.0, 2))
    (decision,) = broadcast(run.send(101.1, b"n1", report(4.0, 2)), Decision)
    assert decision == reference_decision(tmp_path, 2)


def test_a_stopping_decision_is_sent_again_and_the_finish_follows_once_all_are_back(tmp_path):
    config, decisions = first_run(tmp_path / "run", decided=EPOCHS - 1)
    assert decisions[-1].stop
    run = restarted(config)
    # rank 0 had the stop and waits for the finish, rank 1 missed it: each sends its last report
    run.send(100.0, b"n0", back(0))
    one = run.send(100.1, b"n0", report(1.0 + EPOCHS - 1, EPOCHS - 1, None))
    assert sent(one, Decision) == [(b"n0", decisions[-1])] and not broadcast(one, Finish)
    run.send(100.2, b"n1", back(1))
    both = run.send(100.3, b"n1", report(2.0 + EPOCHS - 1, EPOCHS - 1, None))
    assert sent(both, Decision) == [(b"n1", decisions[-1])]
    (finish,) = broadcast(both, Finish)
    assert finish.best_epoch == decisions[-1].best_epoch
    ended = run.send(100.4, b"n0", Done()) + run.send(100.5, b"n1", Done())
    assert [a for a in ended if isinstance(a, Finished)]


def test_a_journaled_go_answers_a_ready_sent_again(tmp_path):
    config, _ = first_run(tmp_path / "run", decided=-1)  # only epoch 0's go went out
    run = restarted(config)
    carry = resume.inspect(config, None).carry
    assert carry is not None and carry.decision is None
    go = carry.go
    for rank in (0, 1):
        run.send(100.0 + rank, f"n{rank}".encode(), back(rank))
        answer = run.send(100.5 + rank, f"n{rank}".encode(), ready(rank))
        assert sent(answer, Go) == [(f"n{rank}".encode(), go)]
    assert not run.machine.taking_back and run.machine.phase is RunPhase.RUNNING
    run.send(101.0, b"n0", report(1.0, 0))
    (decision,) = broadcast(run.send(101.1, b"n1", report(2.0, 0)), Decision)
    assert decision == reference_decision(tmp_path, 0)


def test_rank_0s_lost_commit_of_the_last_checkpoint_is_journaled_once(tmp_path):
    config, decisions = first_run(tmp_path / "run", decided=1)
    assert decisions[1].checkpoint  # the last decision asked for a checkpoint
    # rank 0 wrote it (with rank 1, once that one got the decision) and sent its commit to the
    # dead coordinator; taken back, it sends the commit again with its report
    run = restarted(config)
    run.send(100.0, b"n0", back(0))
    commit = run.send(100.1, b"n0", Checkpointed(epoch=1))
    assert [a.record for a in commit if isinstance(a, Journal)] == [
        {"kind": "checkpoint", "epoch": 1}
    ]
    assert run.send(100.2, b"n0", Checkpointed(epoch=1)) == []  # once
    assert run.send(100.3, b"n0", Checkpointed(epoch=0)) == []  # not the one asked for last
    assert run.machine.taking_back  # rank 1 is still to come


def test_workers_started_again_resume_from_the_checkpoint_and_the_journal_is_cut_back(tmp_path):
    config, _ = first_run(tmp_path / "run", decided=1)
    run = restarted(config)
    actions = run.send(100.0, b"f0", hello("f0"))  # a worker in no run
    assert [a.record for a in actions if isinstance(a, Journal)] == [
        {"records": []}  # no checkpoint: the run starts over
    ]
    assert sent(actions, Joined) and not sent(actions, Welcome)
    # a worker of the old run now joins that rendezvous as any worker does
    later = run.send(100.5, b"n1", back(1))
    assert not [m for _, m in sent(later, Welcome) if m.carry_on]


def test_ranks_that_do_not_come_back_end_the_run_after_the_stall_bound(tmp_path):
    config, _ = first_run(tmp_path / "run", decided=1, rendezvous_timeout=30.0, stall_abort=60.0)
    run = restarted(config, now=0.0)
    run.send(0.0, b"n1", back(1))
    refused = run.send(1.0, b"x", hello("x"))  # a worker in no run meanwhile
    assert sent(refused, Reject) == [(b"x", Reject(reason=TAKING_BACK, code="refused"))]
    run.send(5.0, b"n1", report(3.0, 1))  # back at 5.0: rank 0 has 60 s from here
    step = config.heartbeat_interval
    now = 5.0
    while now + step < 5.0 + 60.0:  # rank 1 heartbeats; rank 0 is still training, say
        now += step
        run.send(now, b"n1", Heartbeat())
        assert aborted(run.machine.on_tick(now)) is None
    run.send(65.5, b"n1", Heartbeat())
    reason = aborted(run.machine.on_tick(65.5))
    assert reason is not None and reason.startswith(
        "rank 0 of the run did not come back to the restarted coordinator within 60 s "
        "(--stall-abort)"
    ), reason


def test_with_no_worker_back_the_restart_waits_as_long_for_the_first(tmp_path):
    # every rank may be training when the coordinator died: none says hello before its epoch
    # ends, so the first has the stall bound too, not only the rendezvous timeout
    config, _ = first_run(tmp_path / "run", decided=1, rendezvous_timeout=30.0, stall_abort=60.0)
    run = restarted(config, now=0.0)
    assert aborted(run.machine.on_tick(59.9)) is None
    reason = aborted(run.machine.on_tick(60.1))
    assert reason is not None and reason.startswith(
        "no worker came back to the restarted coordinator within 60 s (--stall-abort)"
    ), reason


def test_an_elastic_world_keeps_its_generation(tmp_path):
    config, _ = first_run(tmp_path / "run", decided=1, min_workers=1)
    journal = tmp_path / "run" / "epochs.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    for record in records:  # as a run whose world changed twice would have journaled them
        record["generation"] = 2
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = restarted(config)
    (welcome,) = [m for _, m in sent(run.send(100.0, b"n0", back(0)), Welcome)]
    assert welcome.generation == 2
    stale = dataclasses.replace(report(2.0, 1), generation=1)
    assert aborted(run.send(100.1, b"n0", stale)) is not None  # out of step, never answered
    run = restarted(config)
    for rank in (0, 1):
        run.send(100.0, f"n{rank}".encode(), back(rank))
        run.send(100.1, f"n{rank}".encode(), dataclasses.replace(report(2.0, 1), generation=2))
    assert run.machine.membership.world is not None
    assert run.machine.membership.world.generation == 2


def test_after_a_decision_that_gathered_the_readies_are_kept_and_the_go_follows(tmp_path):
    # an elastic world of shards decided epoch 1 with newcomers waiting: no go, the ranks gather
    # their parts onto rank 0 and say ready for epoch 2. The coordinator died there; the
    # newcomers it held are gone, so the world carries on as it is.
    config, decisions = first_run(tmp_path / "run", decided=1, min_workers=1)
    gathered = dataclasses.replace(decisions[1], go=None, gather=True)
    journal = tmp_path / "run" / "epochs.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    records[-1]["next"]["sent"] = sent_record(gathered)
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    carry = resume.inspect(config, None).carry
    assert carry is not None and carry.gathering and not carry.stopped and carry.epoch == 2
    run = restarted(config)
    run.send(100.0, b"n1", back(1))
    again = run.send(100.1, b"n1", report(3.0, 1))  # it missed the decision: the journal's
    assert sent(again, Decision) == [(b"n1", gathered)]
    run.send(100.2, b"n0", back(0))
    run.send(100.3, b"n0", Checkpointed(epoch=1))
    back_all = run.send(100.4, b"n0", ready(0, epoch=2))  # it had it, gathered, and waits
    assert aborted(back_all) is None and not broadcast(back_all, Go)
    assert any("the run carries on in epoch 2" in line for line in logged(back_all))
    assert run.machine.phase is RunPhase.READY and not run.machine.taking_back
    go = run.send(101.0, b"n1", ready(1, epoch=2))  # gathered in turn
    (started,) = broadcast(go, Go)
    assert started.epoch == 2 and run.machine.phase is RunPhase.RUNNING


async def test_a_restarted_service_keeps_the_run_id_its_workers_know(ctx, tmp_path):
    first_run(tmp_path / "run", decided=1)
    coordinator, task = await serve(ctx, epochs=EPOCHS, run_dir=tmp_path / "run")
    try:
        assert coordinator.run_id == "r1"  # a second restart still knows the workers' run
        run = json.loads((tmp_path / "run" / "run.json").read_text())
        assert run["run_id"] == "r1"
    finally:
        coordinator.abort("the test is over")
        with contextlib.suppress(RunAborted):
            await task


def test_a_journal_without_whole_decisions_carries_nothing(tmp_path):
    config, _ = first_run(tmp_path / "run", decided=1)
    journal = tmp_path / "run" / "epochs.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    journal.write_text(
        "".join(
            json.dumps({k: v for k, v in r.items() if k != "next"}) + "\n"
            for r in records
            if r["kind"] != "go"
        )
    )
    assert resume.inspect(config, None).carry is None
