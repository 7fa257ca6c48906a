"""The run directory's files: private to the run's owner, records checked field by field."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from epochal.coordinator.journal import EPOCHS_FILE, RESULT_FILE, RUN_FILE, Journal, check_record


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_file_the_journal_writes_is_private(tmp_path: Path):
    # run.json names the endpoint and the run id: other users must not read it
    old = os.umask(0o022)
    try:
        journal = Journal(tmp_path)
        journal.start({"run_id": "r", "endpoint": "tcp://127.0.0.1:1"})
        journal.epoch({"kind": "checkpoint", "epoch": 0})
        journal.rewrite([{"kind": "checkpoint", "epoch": 0}])
        journal.result({"status": "finished"})
        journal.close()
    finally:
        os.umask(old)
    for name in (RUN_FILE, EPOCHS_FILE, RESULT_FILE):
        assert mode(tmp_path / name) == 0o600, name


def test_a_file_left_readable_by_an_older_version_is_made_private(tmp_path: Path):
    (tmp_path / RUN_FILE).write_text("{}")
    (tmp_path / EPOCHS_FILE).write_text("")
    os.chmod(tmp_path / RUN_FILE, 0o644)
    os.chmod(tmp_path / EPOCHS_FILE, 0o644)
    journal = Journal(tmp_path)
    journal.start({"run_id": "r"})
    journal.close()
    assert mode(tmp_path / RUN_FILE) == 0o600
    assert mode(tmp_path / EPOCHS_FILE) == 0o600


GOOD = {"kind": "epoch", "epoch": 3, "train_loss": 1, "valid_loss": None, "validates": False}


@pytest.mark.parametrize(
    "record",
    [GOOD, GOOD | {"valid_loss": 0.5}, {"kind": "checkpoint", "epoch": 0}],
)
def test_well_formed_records_pass(record: dict):
    check_record(record)


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ([], "a record is a JSON object"),
        ({"kind": "note"}, "kind is 'note'"),
        ({"kind": "checkpoint"}, "field 'epoch' is missing"),
        ({"kind": "checkpoint", "epoch": "1"}, "field 'epoch' is '1', not a int"),
        ({"kind": "checkpoint", "epoch": False}, "field 'epoch' is False"),
        ({"kind": "checkpoint", "epoch": -2}, "epoch is -2, below 0"),
        (GOOD | {"train_loss": None}, "field 'train_loss' is None, not a float"),
        ({k: v for k, v in GOOD.items() if k != "validates"}, "field 'validates' is missing"),
        (GOOD | {"validates": 1}, "field 'validates' is 1, not a bool"),
    ],
)
def test_malformed_records_are_named(record: object, says: str):
    with pytest.raises(ValueError) as info:
        check_record(record)
    assert says in str(info.value)
