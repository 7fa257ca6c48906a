"""The worker's epoch loop (``Session.run_epochs``) against a scripted coordinator: no sockets.

The scripted client answers as the coordinator does: ``go`` to an ``epoch_ready``, and to a loss
report a ``decision`` that carries the next epoch's ``go`` (planned from the counts the report
carried) unless the run stops, then ``finish``. The tests check what the worker sends.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import pytest
import torch

from epochal.errors import CoordinatorLost
from epochal.output import PEER_LOST
from epochal.protocol import (
    Awaiting,
    Decision,
    Done,
    EpochReady,
    EpochReport,
    Fingerprint,
    Finish,
    Go,
    Hello,
    Liveness,
    Message,
    Phase,
    Welcome,
)
from epochal.worker.control.admission import StillRunning
from epochal.worker.control.exits import failure_reason
from epochal.worker.session import Session
from epochal.worker.sessionparts import reattach
from epochal.worker.training.results import EpochContext, LossSum

FP = Fingerprint(digest="a" * 64, torch_version="x", entries=1)


class ScriptedClient:
    """What Session uses of a ControlClient, with the coordinator's answers scripted."""

    def __init__(self, epochs: int, lost_at: int | None = None) -> None:
        self.epochs = epochs
        self.lost_at = lost_at  # the epoch whose decision comes only after a lost coordinator
        self.sent: list[Message] = []
        self.inbox: deque[Message] = deque()
        self.waits: list[tuple[Phase, int, Awaiting | None]] = []
        self.announced: list[tuple[Phase, bool]] = []
        self.rank: int | None = None
        self.epoch = 0
        self.session = "s" * 43
        self.queued: Message | None = None  # what a stalled coordinator still holds

    def at(
        self, phase: Phase, epoch: int, awaiting: Awaiting | None = None, *, announce: bool = True
    ) -> None:
        self.waits.append((phase, epoch, awaiting))
        self.announced.append((phase, announce))
        self.epoch = epoch

    def send(self, message: Message) -> None:
        self.sent.append(message)
        if isinstance(message, EpochReady):
            self.inbox.append(Go(message.epoch, message.train_batches, 0, 1.0))
        elif isinstance(message, EpochReport):
            stop = message.epoch + 1 >= self.epochs
            ready = message.ready
            go = None if ready is None else Go(ready.epoch, ready.train_batches, 0, 0.5)
            decision = Decision(message.epoch, 1.0, None, None, None, False, False, stop, go=go)
            if message.epoch == self.lost_at:
                self.queued = decision
            else:
                self.inbox.append(decision)
            if stop:
                self.inbox.append(Finish(None, None, self.epochs, False))

    def receive(self, timeout: float | None = None) -> Message:
        if not self.inbox:
            raise CoordinatorLost("the coordinator sent nothing for 3 s")
        return self.inbox.popleft()

    def watch_coordinator(self) -> None:
        pass


def welcome(client: ScriptedClient, **changes: Any) -> Welcome:
    """The coordinator's Welcome to ``client``'s worker: rank 0 of a world of one, from epoch 0
    of run r1 in ``client``'s session, with ``changes`` to its fields."""
    first = Welcome(
        rank=0,
        world_size=1,
        run_id="r1",
        backend="gloo",
        store_host="127.0.0.1",
        store_port=1,
        start_epoch=0,
        epochs=client.epochs,
        resume_epoch=None,
        checkpoint_dir="",
        session=client.session,
        liveness=Liveness(),
    )
    return dataclasses.replace(first, **changes)


def session(client: ScriptedClient, *, reattach_timeout: float = 0.0) -> Session:
    hello = Hello("epochal", "", "w0", "host", 1, 0, "cpu", FP)
    return Session(
        client,  # type: ignore[arg-type]
        welcome(client),
        torch.device("cpu"),
        None,  # type: ignore[arg-type]
        hello=hello,
        endpoint="tcp://127.0.0.1:1",
        reattach_timeout=reattach_timeout,
        store_timeout=1.0,
    )


def trainer(seen: list[tuple[int, int, float]]) -> Any:
    def train(ctx: EpochContext) -> LossSum:
        seen.append((ctx.epoch, ctx.train_batches, ctx.lr_factor))
        return LossSum(1.0, 1)

    return train


def test_only_the_first_epoch_is_announced_on_its_own_the_reports_carry_the_next():
    client = ScriptedClient(epochs=3)
    asked: list[int] = []

    def batches(epoch: int) -> tuple[int, int | None]:
        asked.append(epoch)
        return 10 + epoch, None

    seen: list[tuple[int, int, float]] = []
    result = session(client).run_epochs(trainer(seen), batches=batches)
    assert [type(m).__name__ for m in client.sent] == [
        "EpochReady",
        "EpochReport",
        "EpochReport",
        "EpochReport",
        "Done",
    ]
    assert client.sent[0] == EpochReady(0, 10, None)
    reports = [m for m in client.sent if isinstance(m, EpochReport)]
    assert [r.ready for r in reports] == [EpochReady(1, 11, None), EpochReady(2, 12, None), None]
    assert asked == [0, 1, 2]  # never asked for the counts of an epoch past the last
    # each epoch ran the go it was given: the first one's own, the others' from the decision
    assert seen == [(0, 10, 1.0), (1, 11, 0.5), (2, 12, 0.5)]
    assert [r.lr_factor for r in result.curve] == [1.0, 0.5, 0.5]
    waits = [(e, a) for p, e, a in client.waits if p is Phase.WAITING]
    assert waits == [
        (0, Awaiting.GO),
        (0, Awaiting.DECISION),
        (1, Awaiting.DECISION),
        (2, Awaiting.DECISION),
    ]
    # after the last decision the rank finishes that epoch, not one past the run's last
    assert client.waits[-1] == (Phase.FINISHING, 2, None)
    # a wait is said by the message sent right after it (the ready, the report), training by the
    # go the rank was sent and validation by the next heartbeat: no Status of their own; every
    # other change of phase is announced at once
    quiet = {Phase.WAITING, Phase.TRAIN, Phase.VALIDATE}
    said_by_others = {phase for phase, announce in client.announced if not announce}
    assert {Phase.WAITING, Phase.TRAIN} <= said_by_others <= quiet
    assert all(announce for phase, announce in client.announced if phase not in quiet)
    assert any(announce for phase, announce in client.announced)  # SETUP, FINISHING


def test_each_report_carries_the_rate_the_optimizer_holds_when_the_loop_says_it():
    rates = iter([0.1, 0.05, float("nan")])  # a rate that is not a number is not sent
    client = ScriptedClient(epochs=3)
    session(client).run_epochs(trainer([]), batches=(4, None), learning_rate=lambda: next(rates))
    assert [m.lr for m in client.sent if isinstance(m, EpochReport)] == [0.1, 0.05, None]
    client = ScriptedClient(epochs=2)  # without learning_rate=: not known
    session(client).run_epochs(trainer([]), batches=(4, None))
    assert [m.lr for m in client.sent if isinstance(m, EpochReport)] == [None, None]


def test_a_decision_that_stops_early_needs_no_go(monkeypatch: pytest.MonkeyPatch):
    client = ScriptedClient(epochs=3)
    original = client.send

    def stop_after_the_first(message: Message) -> None:
        original(message)
        if isinstance(message, EpochReport):  # a stop by patience: no go, finish follows
            client.inbox.clear()
            client.inbox.append(Decision(0, 1.0, None, None, None, False, False, True))
            client.inbox.append(Finish(0, 1.0, 1, False))

    monkeypatch.setattr(client, "send", stop_after_the_first)
    seen: list[tuple[int, int, float]] = []
    result = session(client).run_epochs(trainer(seen), batches=(4, None))
    assert seen == [(0, 4, 1.0)] and result.epochs_run == 1
    assert isinstance(client.sent[-1], Done)


def test_a_stalled_coordinator_s_queued_decision_carries_the_go_the_worker_goes_on_with(
    monkeypatch: pytest.MonkeyPatch,
):
    client = ScriptedClient(epochs=3, lost_at=0)

    def say_hello_again(*args: Any, answers: tuple[type[Any], ...] = (), **kw: Any) -> Any:
        # the same coordinator, stalled: what it queued is the answer the worker waited for
        assert answers == (Decision,)
        assert client.queued is not None
        raise StillRunning(client.queued)

    monkeypatch.setattr(reattach, "rendezvous", say_hello_again)
    seen: list[tuple[int, int, float]] = []
    session(client, reattach_timeout=5.0).run_epochs(trainer(seen), batches=(4, None))
    assert seen == [(0, 4, 1.0), (1, 4, 0.5), (2, 4, 0.5)]
    # no second announcement of epoch 1: its go came with the queued decision
    assert [type(m).__name__ for m in client.sent].count("EpochReady") == 1


def test_a_rank_that_lost_a_data_plane_peer_says_so_in_words_its_own_errors_as_they_are():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:12345"
    )
    reason = failure_reason(gloo)
    assert reason == f"{PEER_LOST}; the RuntimeError it raised is in this worker's output"
    assert "gloo" not in reason and "127.0.0.1" not in reason
    assert failure_reason(ValueError("boom: in the loss")) == "ValueError: boom: in the loss"


class ClosingClient(ScriptedClient):
    """A coordinator that answers a Done before any epoch with the run's Finish (or, with
    ``answer=False``, says nothing at all); closing is recorded."""

    def __init__(self, *, answer: bool = True) -> None:
        super().__init__(epochs=1)
        self.answer = answer
        self.liveness = Liveness()
        self.closed = False
        self.closed_finished: bool | None = None

    def send(self, message: Message) -> None:
        self.sent.append(message)
        if isinstance(message, Done) and self.answer:
            self.inbox.append(Finish(None, None, 0, False))

    def receive(self, timeout: float | None = None) -> Message:
        if not self.inbox:
            raise TimeoutError("no message from the coordinator")
        return self.inbox.popleft()

    def close(self, *, flush: float = 2.0, finished: bool = False) -> None:
        self.closed = True
        self.closed_finished = finished


@pytest.mark.parametrize("answer", [True, False], ids=["finished", "no-answer"])
def test_a_session_closed_cleanly_before_any_epoch_says_done_and_waits_for_the_finish(
    answer: bool,
):
    # a script with a loop of its own used join() for the process group only
    client = ClosingClient(answer=answer)
    with session(client):  # type: ignore[arg-type]
        pass
    assert client.sent == [Done()] and client.closed
    assert client.closed_finished is True  # once the coordinator has gone, nothing to linger for
    assert client.waits[-1] == (Phase.FINISHING, 0, None)  # its heartbeats say it is finishing
    assert not client.inbox  # the Finish was taken (when one came)


def test_a_session_left_by_an_exception_or_after_its_epochs_says_no_early_done():
    client = ClosingClient()
    with pytest.raises(ValueError), session(client):  # type: ignore[arg-type]
        raise ValueError("the script failed")
    assert client.sent == [] and client.closed  # the script's failure is the run's, not a finish
    assert client.closed_finished is False  # what it queued (its Failed) is still sent
    client = ScriptedClient(epochs=1)  # a session that ran its epochs: its Done was the finish's
    client.close = lambda **_: None  # type: ignore[attr-defined]
    s = session(client)
    s.run_epochs(trainer([]), batches=(4, None))
    s.close()
    assert [type(m).__name__ for m in client.sent].count("Done") == 1


def test_a_restarted_coordinator_that_keeps_the_worker_where_it_was_hears_its_report_again(
    monkeypatch: pytest.MonkeyPatch,
):
    client = ScriptedClient(epochs=2, lost_at=0)  # the decision of epoch 0 never comes

    def restarted(*args: Any, answers: tuple[type[Any], ...] = (), **kw: Any) -> Any:
        client.lost_at = None  # the restarted coordinator answers what it is sent again
        return welcome(client, run_id="r2", session="t" * 43, carry_on=True), None

    monkeypatch.setattr(reattach, "rendezvous", restarted)
    seen: list[tuple[int, int, float]] = []
    s = session(client, reattach_timeout=5.0)
    result = s.run_epochs(trainer(seen), batches=(4, None))
    # nothing is redone: the report of epoch 0 is sent again, and its decision's go followed
    assert seen == [(0, 4, 1.0), (1, 4, 0.5)] and result.epochs_run == 2
    reports = [m.epoch for m in client.sent if isinstance(m, EpochReport)]
    assert reports == [0, 0, 1]
    assert s.run_id == "r2"  # what the session knows follows the coordinator that took it back
