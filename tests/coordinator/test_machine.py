"""The run's phase machine driven by a clock the test sets: no sockets, no sleeps.

Each test plays workers by calling :meth:`RunMachine.on_message` and moves the clock with
:meth:`RunMachine.on_tick`; every bound comes from the configured timeouts, checked just before
and just after it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from epochal.coordinator import CoordinatorConfig
from epochal.coordinator.rules import runstate
from epochal.coordinator.rules.actions import (
    Aborted,
    Action,
    Broadcast,
    Finished,
    Journal,
    Log,
    Prune,
    RunPhase,
    Send,
)
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.rules.rendezvous import (
    JOIN_PROGRESS_SECONDS,
    NAMED_JOINS,
    Member,
    placement_lines,
)
from epochal.coordinator.rules.watchdog import FAILURE_SETTLE
from epochal.coordinator.serve import resume
from epochal.protocol import (
    Abort,
    Checkpointed,
    Decision,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Finish,
    Go,
    Heartbeat,
    Joined,
    Liveness,
    Message,
    Metric,
    OpenStore,
    Status,
    StoreReady,
    Welcome,
)
from epochal.protocol.codec import decode_frame, encode
from tests.conftest import hello


def aborted(actions: list[Action]) -> str | None:
    reasons = [a.reason for a in actions if isinstance(a, Aborted)]
    return reasons[0] if reasons else None


def logged(actions: list[Action]) -> list[str]:
    return [a.line for a in actions if isinstance(a, Log)]


def sent(actions: list[Action], kind: type) -> list[tuple[bytes, Any]]:
    return [
        (a.peer, a.message) for a in actions if isinstance(a, Send) and isinstance(a.message, kind)
    ]


def broadcast(actions: list[Action], kind: type) -> list[Any]:
    return [a.message for a in actions if isinstance(a, Broadcast) and isinstance(a.message, kind)]


@dataclass
class Run:
    """A machine and the workers playing against it; ``peers[rank]`` once ranks are assigned."""

    machine: RunMachine
    sessions: dict[bytes, str] = field(default_factory=dict)
    peers: list[bytes] = field(default_factory=list)

    def send(self, now: float, peer: bytes, message: Message) -> list[Action]:
        actions = self.machine.on_message(now, peer, message, session=self.sessions.get(peer, ""))
        for action in actions:
            if isinstance(action, Send) and isinstance(action.message, Joined | Welcome):
                self.sessions[action.peer] = action.message.session
        return actions

    def all(self, now: float, make: Any) -> list[Action]:
        """Every rank sends ``make(rank)``; the actions of all of them."""
        out: list[Action] = []
        for rank, peer in enumerate(self.peers):
            out += self.send(now, peer, make(rank))
        return out


def start(now: float = 0.0, resumed: int | None = None, **settings: Any) -> Run:
    """A run with every worker joined and welcomed at ``now`` (phase ready); ``resumed``: the run
    resumes after that epoch (its outcomes replayed as on resume)."""
    config = CoordinatorConfig(**{"world_size": 2, "epochs": 2, **settings})
    state = resume.inspect(config, None)
    if resumed is not None:
        for epoch in range(resumed + 1):
            state.loop.update(epoch, 1.0, 1.0, validates=True)
        state = runstate.RunState(loop=state.loop, resume_epoch=resumed)
    run = Run(RunMachine(config, state, run_id="r1", now=now))
    actions: list[Action] = []
    for i in range(config.world_size):
        actions += run.send(now, f"w{i}".encode(), hello(f"w{i}"))
    opener = [a.peer for a in actions if isinstance(a, Send) and isinstance(a.message, OpenStore)]
    assert len(opener) == 1 and run.machine.phase is RunPhase.STORE
    welcome = run.send(now, opener[0], StoreReady(host="127.0.0.1", port=4242, key="k"))
    ranks = {
        a.peer: a.message.rank
        for a in welcome
        if isinstance(a, Send) and isinstance(a.message, Welcome)
    }
    run.peers = sorted(ranks, key=ranks.__getitem__)
    assert run.machine.phase is RunPhase.READY
    return run


def ready(rank: int, epoch: int = 0) -> EpochReady:
    return EpochReady(epoch=epoch, train_batches=5, valid_batches=2)


def report(
    valid_sum: float, epoch: int, then: tuple[int, int | None] | None = (5, 2)
) -> EpochReport:
    """A rank's loss report of ``epoch``, carrying its batch counts ``then`` for the next epoch
    (None: there is no next epoch)."""
    ready = None if then is None else EpochReady(epoch + 1, *then)
    return EpochReport(
        epoch=epoch,
        train_loss_sum=1.0,
        train_count=1,
        valid_loss_sum=valid_sum,
        valid_count=2,
        ready=ready,
    )


def last(valid_sum: float, epoch: int) -> EpochReport:
    """A rank's loss report of the run's last epoch: no batch counts for a next one."""
    return report(valid_sum, epoch, None)


# ----------------------------------------------------------------------------- a whole run


def test_a_whole_run_records_each_epoch_before_deciding_it_and_ends_with_its_history():
    run = start(epochs=3)
    sums = [(8.0, 2.0), (3.0, 3.0), (5.0, 5.0)]  # global: 10/4, 6/4, 10/4
    go = broadcast(run.all(10.0, ready), Go)  # only the first epoch is announced on its own
    assert go == [Go(epoch=0, train_batches=5, valid_batches=2, lr_factor=1.0)]
    finish: list[Action] = []
    for epoch, pair in enumerate(sums):
        now = 10.0 * (epoch + 1)
        make = report if epoch < 2 else last
        actions = run.all(now + 1.5, lambda r, e=epoch, p=pair, m=make: m(p[r], e))
        kinds = [type(a).__name__ for a in actions if isinstance(a, Journal | Broadcast)]
        assert kinds[:2] == ["Journal", "Broadcast"]  # durable before the ranks hear of it
        record = next(a.record for a in actions if isinstance(a, Journal))
        # an epoch lasts from its go (at 10.0, then with each decision) to its decision
        seconds = 1.5 if epoch == 0 else 10.0
        assert record["kind"] == "epoch" and record["seconds"] == seconds and "time" not in record
        (decision,) = broadcast(actions, Decision)
        assert decision.valid_loss == pytest.approx(sum(pair) / 4)
        assert decision.is_best == (epoch in (0, 1)) and decision.stop == (epoch == 2)
        assert any(line.startswith(f"epoch {epoch} [{epoch + 1}/3]") for line in logged(actions))
        if epoch < 2:  # the next epoch starts with the decision: its go rides along
            assert decision.go == Go(
                epoch=epoch + 1, train_batches=5, valid_batches=2, lr_factor=1.0
            )
            assert broadcast(actions, Go) == []
            assert (run.machine.phase, run.machine.epoch) == (RunPhase.RUNNING, epoch + 1)
        finish = actions
    assert broadcast(finish, Finish) == [
        Finish(best_epoch=1, best_loss=1.5, epochs_run=3, restore_best=True)
    ]
    assert run.machine.phase is RunPhase.FINISHING
    assert run.send(40.0, run.peers[0], Done()) == []
    end = run.send(40.0, run.peers[1], Done())
    assert [type(a) for a in end] == [Journal, Finished]
    summary = end[-1].summary  # type: ignore[union-attr]
    assert (summary.best_epoch, summary.epochs_run) == (1, 3)
    assert [o.epoch for o in summary.history] == [0, 1, 2]
    assert run.machine.on_tick(1000.0) == []  # over: nothing more happens


def test_uneven_batches_abort_every_worker():
    run = start()
    run.send(1.0, run.peers[0], EpochReady(epoch=0, train_batches=48, valid_batches=None))
    actions = run.send(1.0, run.peers[1], EpochReady(epoch=0, train_batches=47, valid_batches=None))
    reason = aborted(actions)
    assert reason is not None and "rank 0 has 48, rank 1 has 47 train batches" in reason
    (abort,) = broadcast(actions, Abort)
    assert "rank 1 has 47" in abort.reason
    assert {a.record["status"] for a in actions if isinstance(a, Journal)} == {"aborted"}


def test_checkpoints_beyond_those_kept_are_pruned():
    run = start(epochs=5, checkpoint_dir=Path("/nowhere"), keep_checkpoints=1)
    run.all(1.0, ready)
    for epoch in range(3):
        run.all(2.0, lambda r, e=epoch: report(10.0 - e, e))  # every epoch a new best
    first = run.send(3.0, run.peers[0], Checkpointed(epoch=0))
    assert [type(a) for a in first] == [Journal]
    second = run.send(3.0, run.peers[0], Checkpointed(epoch=1))
    assert [a for a in second if isinstance(a, Prune)] == [Prune((0,))]


# ----------------------------------------------------------------------------- one exchange


def test_between_two_trainings_one_exchange_waits_for_every_rank_s_report():
    run = start(epochs=3, batch_policy="truncate")
    run.all(1.0, ready)
    # rank 0 has reported, rank 1 not yet: nothing is decided
    assert run.send(2.0, run.peers[0], report(1.0, 0, then=(5, None))) == []
    assert run.machine.phase is RunPhase.RUNNING and run.machine.epoch == 0
    actions = run.send(2.5, run.peers[1], report(1.0, 0, then=(7, None)))
    (decision,) = broadcast(actions, Decision)
    # planned as from epoch_ready: the minimum under truncate; no validation loader, no validation
    assert decision.go == Go(epoch=1, train_batches=5, valid_batches=0, lr_factor=1.0)
    assert not decision.stop and broadcast(actions, Go) == []
    assert (run.machine.phase, run.machine.epoch) == (RunPhase.RUNNING, 1)
    # the next epoch is running: an epoch_ready of it is out of step, not a second announcement
    reason = aborted(run.send(3.0, run.peers[0], ready(0, epoch=1)))
    assert reason is not None and "sent EpochReady while the coordinator was in phase running" in (
        reason
    )


def test_the_next_epoch_s_counts_against_the_batch_policy_abort_naming_that_epoch():
    run = start(epochs=3)
    run.all(1.0, ready)
    run.send(2.0, run.peers[0], report(1.0, 0, then=(48, None)))
    actions = run.send(2.0, run.peers[1], report(1.0, 0, then=(47, None)))
    reason = aborted(actions)
    assert reason is not None
    assert reason.startswith("epoch 1: rank 0 has 48, rank 1 has 47 train batches")
    assert broadcast(actions, Decision) == []  # the run stops: no rank trains epoch 1
    (abort,) = broadcast(actions, Abort)
    assert abort.reason.startswith("epoch 1: rank 0 has 48")
    journaled = [a.record for a in actions if isinstance(a, Journal)]
    assert [r.get("kind", r.get("status")) for r in journaled] == ["epoch", "aborted"]
    assert journaled[0]["epoch"] == 0  # epoch 0 was decided and is kept, as it always was


def test_a_report_without_the_next_epoch_s_counts_is_out_of_step_when_the_run_goes_on():
    run = start(epochs=3)
    run.all(1.0, ready)
    run.send(2.0, run.peers[0], report(1.0, 0))
    reason = aborted(run.send(2.0, run.peers[1], last(1.0, 0)))
    assert reason is not None and reason.startswith(
        "rank 1 reported epoch 0 without its batch counts for epoch 1: the worker and "
        "coordinator are out of step"
    )


def test_a_decision_that_stops_carries_no_go_whatever_counts_the_reports_carried():
    run = start(epochs=3, patience=0, best_from=0)
    run.all(1.0, ready)
    run.all(2.0, lambda r: report(1.0, 0))
    # no improvement at epoch 1 with patience 0: the run stops before its last epoch
    actions = run.all(3.0, lambda r: report(5.0, 1, then=(1, None) if r else (9, 2)))
    assert aborted(actions) is None  # the counts of an epoch that never runs are not checked
    (decision,) = broadcast(actions, Decision)
    assert decision.stop and decision.go is None
    assert broadcast(actions, Finish) and run.machine.phase is RunPhase.FINISHING


def test_a_resumed_run_announces_its_first_epoch_with_epoch_ready_again():
    run = start(epochs=4, resumed=1, checkpoint_dir=Path("/nowhere"))
    assert run.machine.epoch == 2 and run.machine.phase is RunPhase.READY
    early = aborted(run.send(1.0, run.peers[0], report(1.0, 2)))  # a report before any Go
    assert (
        early is not None and "sent EpochReport while the coordinator was in phase ready" in early
    )
    run = start(epochs=4, resumed=1, checkpoint_dir=Path("/nowhere"))
    (go,) = broadcast(run.all(1.0, lambda r: ready(r, 2)), Go)
    assert go.epoch == 2
    (decision,) = broadcast(run.all(2.0, lambda r: report(1.0, 2)), Decision)
    assert decision.go is not None and decision.go.epoch == 3


def test_a_lost_report_is_named_in_any_epoch_and_a_late_decision_is_not_blamed():
    run = start(epochs=3, heartbeat_interval=0.5, heartbeat_timeout=10.0)  # margin: 2 s
    run.all(1.0, ready)
    run.all(2.0, lambda r: report(1.0, 0))  # epoch 1 runs from 2.0: its go rode the decision
    # rank 1 has not heard that decision yet (a wide broadcast): it still waits for it, in vain
    # as far as it knows, but its report of epoch 0 arrived: it is only late to hear, not lost
    late = Status(phase="waiting", epoch=0, step=0, where="", awaiting="decision")
    run.send(2.5, run.peers[1], late)
    for t in (3.0, 4.0, 5.0, 6.0):
        run.send(t, run.peers[1], Heartbeat())
        assert aborted(run.machine.on_tick(t)) is None
    run.send(7.0, run.peers[0], report(1.0, 1, then=None))
    waiting = Status(phase="waiting", epoch=1, step=0, where="", awaiting="decision")
    run.send(8.0, run.peers[1], waiting)  # trained epoch 1; its report (and counts) is lost
    run.send(10.0, run.peers[1], Heartbeat())
    assert aborted(run.machine.on_tick(10.0)) is None  # heard for exactly the margin
    run.send(10.01, run.peers[1], Heartbeat())
    reason = aborted(run.machine.on_tick(10.01))
    assert reason is not None and reason.startswith(
        "rank 1 (worker w1 (host testhost, pid 1)) has waited 2.0 s for epoch 1's decision, but "
        "its loss report never arrived"
    )


def test_a_report_or_a_ready_says_its_rank_now_waits_without_a_status_of_its_own():
    # the worker sends no Status when it starts waiting: the epoch_ready or the loss report it
    # sends right then says as much, and the stall table and status.json show it at once
    run = start(epochs=3)
    train = Status(phase="train", epoch=0, step=3, where="train.py:9 in step", awaiting=None)
    run.send(0.5, run.peers[0], train)
    run.send(1.0, run.peers[0], ready(0))
    assert run.machine.watchdog.status[0].phase == "waiting"
    assert run.machine.watchdog.status[0].awaiting == "go"
    run.all(1.0, ready)
    run.send(2.0, run.peers[0], report(1.0, 0))
    row = run.machine.watchdog.status[0]
    assert (row.phase, row.epoch, row.step, row.awaiting, row.since) == (
        "waiting",
        0,
        0,
        "decision",
        2.0,
    )
    assert run.machine.watchdog.where[0] == "train.py:9 in step"  # its line: the next heartbeat's
    assert run.machine.watchdog.status[1].phase == "waiting"  # rank 1 said so with its ready


def test_a_worker_saying_hello_again_mid_epoch_is_welcomed_with_its_own_session():
    # a worker that gave a stalled coordinator up says hello again: the coordinator answers with
    # a welcome carrying the session it holds (so the worker knows it is the same coordinator);
    # the decision it waits for, with its go, is already queued on its connection
    run = start(epochs=3, heartbeat_timeout=1.5)  # the joins (t=0) are not crossing retries
    run.all(1.0, ready)
    session = run.sessions[run.peers[1]]
    actions = run.send(2.0, run.peers[1], hello("w1"))
    (welcome,) = [a.message for a in actions if isinstance(a, Send)]
    assert isinstance(welcome, Welcome) and welcome.session == session and welcome.rank == 1
    assert any("said hello again" in line for line in logged(actions))
    run.send(2.0, run.peers[0], report(1.0, 0))
    (decision,) = broadcast(run.send(2.0, run.peers[1], report(1.0, 0)), Decision)
    assert decision.go is not None and decision.go.epoch == 1


# ----------------------------------------------------------------------------- the clock


def test_heartbeats_go_out_once_per_interval():
    run = start(heartbeat_interval=1.0)
    assert broadcast(run.machine.on_tick(0.0), Heartbeat)
    assert not broadcast(run.machine.on_tick(0.9), Heartbeat)
    assert broadcast(run.machine.on_tick(1.0), Heartbeat)


def test_a_silent_worker_is_declared_lost_after_the_heartbeat_timeout():
    run = start(heartbeat_interval=0.05, heartbeat_timeout=0.3)
    t = 0.0
    while t < 0.3:
        t = round(t + 0.05, 2)
        run.send(t, run.peers[0], Heartbeat())
        assert aborted(run.machine.on_tick(t)) is None  # rank 1 silent, but not for long enough
    reason = aborted(run.machine.on_tick(0.31))
    assert reason is not None
    assert reason.startswith("rank 1 (worker w1 (host testhost, pid 1)) sent nothing for 0.3 s")
    assert "while connecting the data plane: it died, hung or lost its network" in reason


def test_rendezvous_timeout_names_how_many_joined():
    config = CoordinatorConfig(world_size=3, epochs=1, rendezvous_timeout=0.3)
    machine = RunMachine(config, resume.inspect(config, None), run_id="r", now=0.0)
    joined = machine.on_message(0.1, b"w", hello("w"))
    assert any(isinstance(a, Send) and isinstance(a.message, Joined) for a in joined)
    machine.on_message(0.2, b"w", Heartbeat())
    assert aborted(machine.on_tick(0.3)) is None
    reason = aborted(machine.on_tick(0.31))
    assert reason is not None and "only 1 of 3 workers joined within 0.3 s" in reason


def test_a_worker_silent_during_rendezvous_is_dropped():
    config = CoordinatorConfig(world_size=3, epochs=1, heartbeat_timeout=2.0)
    machine = RunMachine(config, resume.inspect(config, None), run_id="r", now=0.0)
    machine.on_message(0.0, b"a", hello("a"))
    machine.on_message(1.0, b"b", hello("b"))
    assert logged(machine.on_tick(2.0)) == []
    lines = logged(machine.on_tick(2.5))
    assert lines == ["worker a (host testhost, pid 1) went silent during rendezvous; dropped"]
    assert list(machine.rendezvous.members) == [b"b"]


def test_a_large_rendezvous_logs_a_few_joins_by_name_then_counts_then_the_full_set():
    world = NAMED_JOINS + 20
    config = CoordinatorConfig(world_size=world, epochs=1)
    machine = RunMachine(config, resume.inspect(config, None), run_id="r", now=0.0)
    lines: list[str] = []
    step = JOIN_PROGRESS_SECONDS / 8  # eight joins per count at most
    for i in range(world):
        peer = f"w{i}".encode()
        lines += logged(machine.on_message(i * step, peer, hello(f"w{i}")))
        lines += logged(machine.on_message(i * step, peer, hello(f"w{i}")))  # its retry
    named = [f"worker w{i} joined from testhost ({i + 1}/{world})" for i in range(NAMED_JOINS)]
    assert lines[:NAMED_JOINS] == named
    counts = lines[NAMED_JOINS:-1]
    # the last named join is the 8th; a count of the joins at most every JOIN_PROGRESS_SECONDS
    assert counts == [f"{n} of {world} workers joined" for n in (NAMED_JOINS + 8, NAMED_JOINS + 16)]
    assert lines[-1] == f"all {world} workers joined (the last: worker w{world - 1} from testhost)"


def test_a_hello_that_crossed_its_joined_is_answered_but_not_logged_as_a_reattach():
    run = start(now=0.0, heartbeat_timeout=3.0)
    peer = run.peers[1]
    retried = run.send(2.9, peer, hello("w1"))  # re-sent before its Joined reached it
    assert [type(a.message) for a in retried if isinstance(a, Send)] == [Welcome]
    assert logged(retried) == []
    later = run.send(3.0, peer, hello("w1"))  # a heartbeat timeout later: it lost the coordinator
    assert [type(a.message) for a in later if isinstance(a, Send)] == [Welcome]
    (line,) = logged(later)
    assert line.startswith("rank 1 (worker w1 (host testhost, pid 1)) said hello again")


def test_store_timeout_names_rank_0():
    run_config = {"store_timeout": 5.0}
    config = CoordinatorConfig(world_size=1, epochs=1, **run_config)
    machine = RunMachine(config, resume.inspect(config, None), run_id="r", now=0.0)
    machine.on_message(1.0, b"w", hello("w"))
    machine.on_message(5.5, b"w", Heartbeat(), session=machine.gate.sessions.issue(b"w", ""))
    assert aborted(machine.on_tick(6.0)) is None
    reason = aborted(machine.on_tick(6.01))
    assert reason == (
        "rank 0 (worker w (host testhost, pid 1)) did not open the data-plane store within 5 s"
    )


def test_a_failure_waits_the_settle_window_for_its_cause():
    run = start()
    run.send(10.0, run.peers[1], Failed(reason="NCCL error"))
    run.machine.report_failure(10.1, "worker 0 (pid 7) exited with status 1", cause=True)
    assert aborted(run.machine.on_tick(10.0 + FAILURE_SETTLE - 0.01)) is None
    reason = aborted(run.machine.on_tick(10.0 + FAILURE_SETTLE))
    assert reason == (
        "worker 0 (pid 7) exited with status 1; then rank 1 (worker w1 (host testhost, pid 1)) "
        "failed: NCCL error"
    )


def test_a_lost_batch_count_is_named_once_its_rank_waited_a_margin_while_heard():
    run = start(heartbeat_interval=0.5, heartbeat_timeout=10.0)  # margin: 2 s
    run.send(1.0, run.peers[0], ready(0))
    run.send(1.0, run.peers[1], Status(phase="waiting", epoch=0, step=0, where="", awaiting="go"))
    run.send(3.0, run.peers[1], Heartbeat())
    assert aborted(run.machine.on_tick(3.0)) is None  # heard for exactly the margin
    run.send(3.01, run.peers[1], Heartbeat())
    reason = aborted(run.machine.on_tick(3.01))
    assert reason is not None and reason.startswith(
        "rank 1 (worker w1 (host testhost, pid 1)) has waited 2.0 s for epoch 0's Go, but its "
        "batch counts never arrived"
    )


def test_a_wait_that_ends_with_its_message_is_no_loss():
    run = start(heartbeat_interval=0.5, heartbeat_timeout=10.0)
    run.send(1.0, run.peers[1], Status(phase="waiting", epoch=0, step=0, where="", awaiting="go"))
    run.send(4.0, run.peers[1], Heartbeat())  # suspected ...
    run.send(4.0, run.peers[1], ready(1))  # ... but its counts were only late
    assert aborted(run.machine.on_tick(4.0)) is None


def test_a_rank_slow_to_hear_its_go_is_not_blamed_for_a_lost_loss_report():
    # a wide broadcast reaches some ranks seconds late: while the run collects loss reports a
    # rank may still say it waits, but for its Go; only its wait for the decision counts
    run = start(heartbeat_interval=0.5, heartbeat_timeout=10.0)  # margin: 2 s
    run.all(1.0, lambda rank: ready(rank))
    assert run.machine.phase is RunPhase.RUNNING
    # its heartbeat says it waits, first seen after the epoch began: the Go is still on its way
    waiting_for_go = Status(phase="waiting", epoch=0, step=0, where="", awaiting="go")
    run.send(1.5, run.peers[1], waiting_for_go)
    for t in (2.0, 3.0, 4.0, 5.0, 6.0):
        run.send(t, run.peers[1], Heartbeat())
        assert aborted(run.machine.on_tick(t)) is None
    waiting_for_decision = Status(phase="waiting", epoch=0, step=0, where="", awaiting="decision")
    run.send(7.0, run.peers[1], waiting_for_decision)  # trained; its loss report is lost
    run.send(9.0, run.peers[1], Heartbeat())
    assert aborted(run.machine.on_tick(9.0)) is None  # heard for exactly the margin
    run.send(9.01, run.peers[1], Heartbeat())
    reason = aborted(run.machine.on_tick(9.01))
    assert reason is not None and reason.startswith(
        "rank 1 (worker w1 (host testhost, pid 1)) has waited 2.0 s for epoch 0's decision, but "
        "its loss report never arrived"
    )


def test_a_rank_waiting_for_its_decision_in_the_ready_phase_is_no_lost_batch_count():
    run = start(heartbeat_interval=0.5, heartbeat_timeout=10.0)  # margin: 2 s
    run.send(
        1.0, run.peers[1], Status(phase="waiting", epoch=0, step=0, where="", awaiting="decision")
    )
    for t in (2.0, 3.0, 4.0):
        run.send(t, run.peers[1], Heartbeat())
        assert aborted(run.machine.on_tick(t)) is None


def test_a_stall_is_reported_once_per_stall_timeout_and_aborted_after_stall_abort():
    run = start(stall_timeout=10.0, stall_abort=25.0, heartbeat_timeout=100.0)
    for rank, peer in enumerate(run.peers):
        run.send(1.0, peer, Status(phase="train", epoch=0, step=3, where=f"x.py:{rank} in f"))
    assert logged(run.machine.on_tick(11.0)) == []
    report = logged(run.machine.on_tick(11.5))
    assert len(report) == 1 and report[0].startswith("no rank has made progress for 10 s")
    assert logged(run.machine.on_tick(21.0)) == []  # said once per stall timeout
    assert len(logged(run.machine.on_tick(21.6))) == 1
    assert aborted(run.machine.on_tick(26.0)) is None
    reason = aborted(run.machine.on_tick(26.1))
    assert reason is not None and "made no progress for 25 s" in reason
    assert "--stall-abort 25" in reason


def test_time_the_coordinator_itself_lost_is_forgiven():
    run = start(heartbeat_interval=1.0, heartbeat_timeout=3.0)
    run.all(1.0, lambda r: Heartbeat())
    lines = logged(run.machine.lost_time(60.0, 58.0))
    assert lines and lines[0].startswith("the coordinator itself was not running for 58.0 s")
    assert aborted(run.machine.on_tick(60.0)) is None  # nobody is blamed for the lost time
    actions = run.send(60.5, run.peers[1], Failed(reason="no coordinator for 3 s"))
    assert actions == []
    reason = aborted(run.machine.on_tick(60.5 + FAILURE_SETTLE))
    assert reason is not None and reason.startswith("this coordinator was not running for 58.0 s")


def test_a_finish_unconfirmed_within_the_finish_timeout_ends_the_run():
    run = start(epochs=1, finish_timeout=5.0, heartbeat_timeout=100.0)
    run.all(1.0, ready)
    run.all(2.0, lambda r: last(1.0, 0))
    run.send(3.0, run.peers[0], Done())
    assert not any(isinstance(a, Finished) for a in run.machine.on_tick(7.0))
    actions = run.machine.on_tick(7.01)
    assert "ranks [1] did not confirm the finish within 5 s" in logged(actions)
    assert isinstance(actions[-1], Finished)


def test_a_rank_silent_after_the_finish_ends_the_run_finished_not_aborted():
    """Its Done can be lost as its process ends (a frame lost, then the socket closed): every
    epoch is decided, so the run ends as finished once the heartbeat timeout passes, well before
    --finish-timeout, with one line naming the rank."""
    run = start(epochs=1, finish_timeout=100.0, heartbeat_timeout=5.0)
    run.all(1.0, ready)
    run.all(2.0, lambda r: last(1.0, 0))
    run.send(2.5, run.peers[1], Done())
    early = run.machine.on_tick(7.0)  # rank 0 last heard at 2.0: not yet past the timeout
    assert not logged(early) and not any(isinstance(a, Finished) for a in early)
    actions = run.machine.on_tick(7.1)
    assert aborted(actions) is None
    (line,) = logged(actions)
    assert line.startswith("rank 0 (") and "has not confirmed the finish" in line
    assert "sent nothing for 5.1 s" in line and "the result stands" in line
    (ended,) = [a for a in actions if isinstance(a, Finished)]
    assert ended.summary.epochs_run == 1
    (result,) = [a.record for a in actions if isinstance(a, Journal) and a.kind == "result"]
    assert result["status"] == "finished"


def test_a_rank_silent_after_another_closed_its_own_loop_early_still_aborts():
    """No epoch was decided (the ranks keep loops of their own): a rank silent past the heartbeat
    timeout may have died in its loop, so the run aborts, while a rank that said done and left
    is not waited for."""
    run = start(epochs=3, heartbeat_timeout=5.0, finish_timeout=100.0)
    run.send(1.0, run.peers[1], Done())  # closed its session, then its process ended
    run.send(4.0, run.peers[0], Heartbeat())  # still in its own loop
    assert aborted(run.machine.on_tick(8.9)) is None  # rank 1 silent 7.9 s: it said done
    reason = aborted(run.machine.on_tick(9.1))
    assert reason is not None and reason.startswith("rank 0 (")
    assert "sent nothing for 5.1 s" in reason


def test_a_failure_reported_after_the_finish_still_aborts():
    run = start(epochs=1, finish_timeout=100.0, heartbeat_timeout=5.0)
    run.all(1.0, ready)
    run.all(2.0, lambda r: last(1.0, 0))
    run.send(2.5, run.peers[1], Done())
    assert run.send(3.0, run.peers[0], Failed(reason="restoring the best weights: disk")) == []
    reason = aborted(run.machine.on_tick(3.0 + FAILURE_SETTLE))
    assert reason is not None and "restoring the best weights: disk" in reason


def test_a_record_that_cannot_be_written_aborts_even_after_the_end():
    run = start(epochs=1)
    run.all(1.0, ready)
    run.all(2.0, lambda r: last(1.0, 0))
    run.send(3.0, run.peers[0], Done())
    assert isinstance(run.send(3.0, run.peers[1], Done())[-1], Finished)
    actions = run.machine.unrecorded("cannot write result.json: disk full")
    assert aborted(actions) == (
        "cannot write result.json: disk full; the run stops because it cannot record its progress"
    )


# ----------------------------------------------------------------------------- who may speak


def test_a_frame_without_its_session_is_counted_and_never_acted_on():
    run = start()
    peer = run.peers[0]
    forged = run.machine.on_message(1.0, peer, ready(0), session="not-it")
    assert logged(forged)[0].startswith("dropped a EpochReady")
    assert run.machine.gate.forged_frames == 1
    # a heartbeat without any session may cross the Joined that carries it: not counted
    assert run.machine.on_message(1.0, peer, Heartbeat()) == []
    assert run.machine.gate.forged_frames == 1


def test_a_stranger_gets_a_few_answers_then_silence():
    run = start()
    budget = run.machine.gate.strangers.replies
    answers = 0
    for _ in range(budget + 5):
        if not run.machine.reads(1.0, b"noisy"):
            continue
        actions = run.machine.on_unreadable(1.0, b"noisy", "junk", version=False)
        answers += len([a for a in actions if isinstance(a, Send)])
    assert answers == budget
    assert run.machine.gate.ignored_frames == 5 and run.machine.gate.dropped_frames == budget


def test_a_message_out_of_step_aborts_naming_the_phase():
    run = start()  # a loss report before the epoch's go (a Done there closes a join-only run)
    reason = aborted(run.send(1.0, run.peers[0], report(1.0, 0)))
    assert reason is not None and "sent EpochReport while the coordinator was in phase ready" in (
        reason
    )


# ----------------------------------------------------------------------------- metrics


def metric_report(epoch: int, correct: float, n: int) -> EpochReport:
    """A rank's report with ``correct`` of ``n`` validation samples right (loss 1 each)."""
    return EpochReport(
        epoch=epoch,
        train_loss_sum=1.0,
        train_count=1,
        valid_loss_sum=float(n),
        valid_count=n,
        valid_metrics=(Metric("accuracy", correct, n),),
    )


def test_metrics_of_uneven_ranks_are_summed_journaled_shown_and_sent_back():
    run = start(epochs=1, monitor="accuracy", monitor_mode="max")
    run.all(1.0, lambda r: ready(r))
    shards = [(3.0, 3), (1.0, 5)]  # 4 of 8 right: 0.5 (the ranks' means would say 0.5667)
    actions = run.all(2.0, lambda r: metric_report(0, *shards[r]))
    (decision,) = broadcast(actions, Decision)
    assert decision.valid_metrics == (Metric("accuracy", 4.0, 8),)
    assert decision.smoothed_loss == 0.5 and decision.is_best
    record = next(a.record for a in actions if isinstance(a, Journal))
    assert record["valid_accuracy"] == 0.5 and record["metrics"] == ["valid_accuracy"]
    said = "valid accuracy 0.5000  smoothed accuracy 0.5000"
    assert any(said in line for line in logged(actions))
    assert any("(smoothed accuracy 0.5000)" in line for line in logged(actions))


def test_monitoring_a_metric_nobody_reports_aborts_at_the_first_report_naming_it():
    run = start(monitor="f1", monitor_mode="max")
    run.all(1.0, lambda r: ready(r))
    actions = run.all(2.0, lambda r: metric_report(0, 1.0, 2))
    reason = aborted(actions)
    assert reason is not None
    assert "--monitor f1: the workers report no validation metric of that name" in reason
    assert "(they report loss, accuracy)" in reason
    assert broadcast(actions, Decision) == []


def placed(host: str, address: str) -> Member:
    return Member(peer=host.encode(), hello=replace(hello("w"), host=host, data_address=address))


def test_where_the_ranks_are_is_said_per_host_and_summed_up_past_a_few_lines():
    two = [placed("a", "10.0.0.1"), placed("b", "10.0.0.2")]
    assert placement_lines(two) == [
        "rank 0: a, data plane at 10.0.0.1",
        "rank 1: b, data plane at 10.0.0.2",
    ]
    # 8 ranks per host on 512 hosts: one line per host for the first few, then a sum
    many = [placed(f"node{r // 8}", f"10.1.{r // 8 // 256}.{r // 8 % 256}") for r in range(4096)]
    lines = placement_lines(many, most=3)
    assert lines == [
        "ranks 0-7: node0, data plane at 10.1.0.0",
        "ranks 8-15: node1, data plane at 10.1.0.1",
        "ranks 16-23: node2, data plane at 10.1.0.2",
        "... and 4072 more ranks on 509 hosts (`epochal status RUN_DIR` lists every rank)",
    ]


def test_counts_that_overflow_the_wire_abort_every_worker_through_the_real_codec():
    # two ranks each report a count the codec accepts (2**64-1); their sum is past what a message
    # can carry: the decision carrying it would not encode, and the coordinator used to die there
    run = start(epochs=2)
    run.all(1.0, lambda r: ready(r))
    top = 2**64 - 1
    frames = [
        encode(
            EpochReport(
                epoch=0,
                train_loss_sum=1.0,
                train_count=1,
                valid_loss_sum=1.0,
                valid_count=1,
                train_metrics=(Metric("hits", 1.0, top),),
                ready=EpochReady(1, 5, 2),
            ),
            session=run.sessions[peer],
        )
        for peer in run.peers
    ]
    actions: list[Action] = []
    for peer, frame in zip(run.peers, frames, strict=True):
        got = decode_frame(frame)
        actions += run.machine.on_message(2.0, peer, got.message, session=got.session)
    reason = aborted(actions)
    assert reason is not None and "training metric 'hits' sample counts of ranks 0-1" in reason
    sent = [a for a in actions if isinstance(a, Send | Broadcast)]
    for action in sent:
        encode(action.message)  # raised OverflowError before: the coordinator exited with 70
    (abort,) = broadcast(actions, Abort)
    assert abort.reason == reason
    assert {p for a in sent if isinstance(a, Broadcast) for p in a.peers} == set(run.peers)
    assert broadcast(actions, Decision) == []


def test_every_worker_is_told_the_runs_heartbeats_when_it_joins_and_is_welcomed():
    # one source: the coordinator's settings, which every worker takes (tests/worker/test_client)
    config = CoordinatorConfig(world_size=2, epochs=2, heartbeat_interval=0.5, heartbeat_timeout=4)
    machine = RunMachine(config, resume.inspect(config, None), run_id="r1", now=0.0)
    run = Run(machine)
    told: list[Any] = []
    for i in range(2):
        told += [
            a.message
            for a in run.send(0.0, f"w{i}".encode(), hello(f"w{i}"))
            if isinstance(a, Send)
        ]
    assert any(isinstance(m, OpenStore) for m in told)
    rank0 = machine.members[0].peer
    told += [
        a.message
        for a in run.send(0.0, rank0, StoreReady(host="h", port=1, key="k"))
        if isinstance(a, Send)
    ]
    joined = [m for m in told if isinstance(m, Joined)]
    welcomed = [m for m in told if isinstance(m, Welcome)]
    assert len(joined) == 2 and len(welcomed) == 2
    assert {m.liveness for m in joined + welcomed} == {Liveness(interval=0.5, timeout=4.0)}


# ----------------------------------------------------------------------------- the rate


def test_the_epoch_line_shows_the_rate_the_ranks_optimizer_holds_and_the_journal_keeps_it():
    run = start(epochs=3, lr_schedule="step:every=1,gamma=0.5")
    run.all(1.0, ready)
    said = run.all(2.0, lambda r: dataclasses.replace(report(1.0, 0), lr=[0.05, None][r]))
    (line,) = [line for line in logged(said) if line.startswith("epoch 0 [")]
    assert "  lr 0.05  best" in line  # the factor is 1 in epoch 0: not repeated
    (record,) = [a.record for a in said if isinstance(a, Journal) and a.kind == "epoch"]
    assert record["lr"] == 0.05 and record["lr_factor"] == 1.0
    # rank 0 said nothing: the first rank that did; the factor beside the rate once it is not 1
    said = run.all(3.0, lambda r: dataclasses.replace(report(1.0, 1), lr=[None, 0.025][r]))
    (line,) = [line for line in logged(said) if line.startswith("epoch 1 [")]
    assert "  lr 0.025 (x0.5)  best" in line
    # no rank says its rate (a custom loop without learning_rate=): the factor alone
    said = run.all(4.0, lambda r: last(1.0, 2))
    (line,) = [line for line in logged(said) if line.startswith("epoch 2 [")]
    assert "  lr x0.25  best" in line
    (record,) = [a.record for a in said if isinstance(a, Journal) and a.kind == "epoch"]
    assert record["lr"] is None


# ----------------------------------------------------------------------------- join() only


def test_ranks_that_close_their_sessions_before_any_epoch_finish_the_run_with_no_epochs():
    run = start(epochs=3)
    first = run.send(1.0, run.peers[1], Done())
    (finish,) = broadcast(first, Finish)  # every rank hears at once that the run is finishing
    assert finish == Finish(best_epoch=None, best_loss=None, epochs_run=0, restore_best=True)
    assert any("rank 1 (" in line and "without running epochs" in line for line in logged(first))
    assert run.machine.phase is RunPhase.FINISHING and not run.machine.over
    last = run.send(2.0, run.peers[0], Done())
    (ended,) = [a for a in last if isinstance(a, Finished)]
    assert ended.summary.epochs_run == 0 and ended.summary.best_epoch is None
    (result,) = [a.record for a in last if isinstance(a, Journal) and a.kind == "result"]
    assert (result["status"], result["epochs_run"]) == ("finished", 0)


def test_a_rank_that_asks_for_an_epoch_after_another_closed_its_session_is_out_of_step():
    run = start(epochs=3)
    run.send(1.0, run.peers[0], Done())
    reason = aborted(run.send(1.5, run.peers[1], ready(1)))
    assert reason is not None and "out of step" in reason, reason
