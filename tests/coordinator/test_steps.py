"""Epochs of N optimizer steps at the coordinator: the steps told to every worker, the shape of a
pass checked across ranks, and each epoch's data position in its journal record."""

from __future__ import annotations

import pytest

from epochal.coordinator import CoordinatorConfig
from epochal.coordinator.rules.actions import Journal
from epochal.coordinator.rules.batches import BatchCounts, EpochPlan, PolicyViolation, plan_epoch
from epochal.coordinator.rules.machine import RunMachine
from epochal.coordinator.serve import resume
from epochal.errors import ConfigError
from epochal.protocol import Decision, EpochReady, EpochReport, Joined, StoreReady, Welcome
from tests.conftest import hello
from tests.coordinator.test_machine import aborted, broadcast, start


def shaped(
    epoch: int, pass_batches: int | None = 10, global_batch: int | None = 8, train: int = 4
) -> EpochReady:
    """A ready of an epoch of ``train`` batches, in passes of ``pass_batches`` global batches
    of ``global_batch`` samples."""
    return EpochReady(epoch, train, None, pass_batches=pass_batches, global_batch=global_batch)


def reported(epoch: int, then: EpochReady | None) -> EpochReport:
    return EpochReport(
        epoch=epoch,
        train_loss_sum=1.0,
        train_count=1,
        valid_loss_sum=0.0,
        valid_count=0,
        ready=then,
    )


@pytest.mark.parametrize("steps", [None, 7])
def test_every_worker_is_told_the_steps_per_epoch(steps):
    config = CoordinatorConfig(world_size=1, epochs=2, steps_per_epoch=steps)
    machine = RunMachine(config, resume.inspect(config, None), run_id="r1", now=0.0)
    joined = machine.on_message(0.0, b"w0", hello("w0"), session="")
    (session,) = [
        a.message.session for a in joined if isinstance(getattr(a, "message", None), Joined)
    ]
    store = StoreReady(host="127.0.0.1", port=4242, key="k")
    welcomes = [
        getattr(a, "message", None) for a in machine.on_message(0.0, b"w0", store, session=session)
    ]
    assert [w.steps_per_epoch for w in welcomes if isinstance(w, Welcome)] == [steps]


def test_steps_per_epoch_must_be_a_whole_number_of_at_least_one():
    with pytest.raises(ConfigError, match="steps_per_epoch must be a whole number >= 1, got 0"):
        CoordinatorConfig(world_size=1, steps_per_epoch=0)


def test_ranks_that_read_passes_of_different_shapes_are_refused_naming_each_one():
    table = {
        0: BatchCounts(4, None, 10, 8),
        1: BatchCounts(4, None, 10, 8),
        2: BatchCounts(4, None, 11, 8),
    }
    with pytest.raises(PolicyViolation) as info:
        plan_epoch(table, "truncate")
    assert str(info.value).startswith(
        "rank 2 has 11 global batches of 8 samples a pass, ranks 0-1 have 10 global batches of "
        "8 samples a pass: every rank must read the same data"
    )
    plan = plan_epoch({0: table[0], 1: table[1]}, "error")
    assert (plan.pass_batches, plan.global_batch) == (10, 8)


@pytest.mark.parametrize(
    ("epoch", "fields"),
    [
        (0, {"steps": 2, "data_pass": 0, "data_offset": 32}),  # 4 of 10 global batches
        (1, {"steps": 2, "data_pass": 0, "data_offset": 64}),
        (2, {"steps": 2, "data_pass": 1, "data_offset": 16}),  # 12 batches: into the next pass
        (4, {"steps": 2, "data_pass": 2, "data_offset": 0}),  # 20: a pass just ended
    ],
)
def test_an_epoch_record_says_where_the_data_stands_after_it(epoch, fields):
    plan = EpochPlan(4, 0, 10, 8)  # 2 steps of 2 accumulated batches an epoch
    assert plan.position(epoch, 2) == {**fields, "pass_batches": 10, "global_batch": 8}
    assert plan.position(epoch, None) == {}
    assert EpochPlan(4, 0).position(epoch, 2) == {"steps": 2}  # a stream: its pass unknown


def test_the_journal_records_each_epochs_steps_and_data_position():
    run = start(epochs=3, steps_per_epoch=4)
    run.all(1.0, lambda r: shaped(0))
    records = []
    for epoch in range(3):
        then = shaped(epoch + 1) if epoch < 2 else None
        actions = run.all(2.0 + epoch, lambda r, e=epoch, t=then: reported(e, t))
        records += [a.record for a in actions if isinstance(a, Journal)]
        assert broadcast(actions, Decision)
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [(r["steps"], r["data_pass"], r["data_offset"]) for r in epochs] == [
        (4, 0, 32),
        (4, 0, 64),
        (4, 1, 16),
    ]


def test_a_run_without_steps_per_epoch_journals_no_data_position():
    run = start(epochs=2)
    run.all(1.0, lambda r: shaped(0))
    actions = run.all(2.0, lambda r: reported(0, shaped(1)))
    (record,) = [a.record for a in actions if isinstance(a, Journal)]
    assert not {"steps", "data_pass", "data_offset"} & set(record)


def test_a_rank_whose_pass_differs_stops_the_run_before_its_epoch():
    run = start(steps_per_epoch=4)
    run.send(1.0, run.peers[0], shaped(0))
    actions = run.send(1.0, run.peers[1], shaped(0, pass_batches=9))
    reason = aborted(actions)
    assert reason is not None and "rank 1 has 9 global batches of 8 samples a pass" in reason
