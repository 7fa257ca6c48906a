"""The line a run says when a pass goes on in global batches of another size (a user's own
per-rank loader resumed or regrouped at another world size mid-pass), table-tested."""

from __future__ import annotations

import pytest

from epochal.coordinator.rules.batches import EpochPlan, last_plan, resliced

TWO = EpochPlan(3, 0, pass_batches=5, global_batch=8)  # a batch of 4 a rank, at 2 workers
THREE = EpochPlan(3, 0, pass_batches=4, global_batch=12)  # the same loader at 3 workers


@pytest.mark.parametrize(
    ("previous", "plan", "epoch"),
    [
        (None, THREE, 2),  # the run's first epoch
        (TWO, TWO, 2),  # the same global batch
        (TWO, THREE, 5),  # 15 global batches in: a pass's start, the new batches do no harm
        (EpochPlan(3, 0), THREE, 2),  # an epoch of one pass: no position
        (TWO, EpochPlan(3, 0), 2),  # the pass's shape not known
    ],
)
def test_nothing_is_said_unless_a_pass_goes_on_in_batches_of_another_size(previous, plan, epoch):
    assert resliced(previous, plan, epoch) is None


def test_a_pass_that_goes_on_in_other_global_batches_says_what_happens_and_what_to_use():
    line = resliced(TWO, THREE, 2)
    assert line is not None and "\n" not in line
    assert line.startswith(
        "epoch 2 goes on with pass 1, 1 of its 5 global batches in, in global batches of 12 "
        "samples where it read 8"
    ), line
    assert "some twice and some never" in line and "epochal.batches(" in line


def test_a_resume_compares_with_the_plan_of_the_last_epoch_journaled():
    records = [
        {"kind": "epoch", "epoch": 0, "train_batches": 3, "valid_batches": 0},
        {"kind": "checkpoint", "epoch": 0},
        {
            "kind": "epoch",
            "epoch": 1,
            "train_batches": 3,
            "valid_batches": 1,
            "pass_batches": 5,
            "global_batch": 8,
        },
        {"kind": "checkpoint", "epoch": 1},
    ]
    assert last_plan(records) == EpochPlan(3, 1, 5, 8)
    assert last_plan([]) is None
    assert last_plan([{"kind": "epoch"}]) is None  # a line without its counts
