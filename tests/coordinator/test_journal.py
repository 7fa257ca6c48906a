"""The run directory's files: private to the run's owner, records checked field by field."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from epochal.coordinator.serve.journal import Journal, JournalError, check_record
from epochal.rundir.paths import EPOCHS_FILE, RESULT_FILE, RUN_FILE


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


def _full_disk(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_a_journal_error_naming_the_file_and_the_fix(tmp_path, monkeypatch):
    journal = Journal(tmp_path)
    monkeypatch.setattr("epochal.coordinator.serve.journal.os.fsync", _full_disk)
    with pytest.raises(JournalError) as info:
        journal.epoch({"kind": "checkpoint", "epoch": 0})
    assert f"cannot write {tmp_path / EPOCHS_FILE}: No space left on device" in str(info.value)
    assert "the disk is full; free space there" in str(info.value)
    with pytest.raises(JournalError, match=r"cannot write .*result\.json"):
        journal.result({"status": "finished"})
    journal.close()


async def test_a_full_disk_mid_run_aborts_every_rank_with_the_reason(tmp_path, monkeypatch):
    import asyncio

    import zmq.asyncio

    from epochal.coordinator import Coordinator, CoordinatorConfig
    from epochal.errors import RunAborted
    from epochal.protocol import Abort, EpochReady, EpochReport, Go
    from tests.coordinator.test_service import join_all

    ctx = zmq.asyncio.Context()
    try:
        config = CoordinatorConfig(world_size=2, epochs=3, run_dir=tmp_path / "run")
        lines: list[str] = []
        coordinator = Coordinator(config, context=ctx, log=lines.append)
        await coordinator.start()
        task = asyncio.create_task(coordinator.run())
        workers = await join_all(ctx, coordinator, 2)
        for w in workers:
            await w.send(EpochReady(epoch=0, train_batches=2, valid_batches=None))
        for w in workers:
            assert isinstance(await w.recv(), Go)
        monkeypatch.setattr("epochal.coordinator.serve.journal.os.fsync", _full_disk)
        for w in workers:
            await w.send(EpochReport(0, 1.0, 1, 0.0, 0, ready=EpochReady(1, 2, None)))
        for w in workers:
            abort = await w.recv()  # not a Decision: it could not be recorded first
            assert isinstance(abort, Abort), abort
            assert "No space left on device" in abort.reason
            assert "cannot record its progress" in abort.reason
        with pytest.raises(RunAborted, match="No space left on device"):
            await asyncio.wait_for(task, 5)
        assert any("the abort is not recorded in the run directory" in line for line in lines)
    finally:
        ctx.destroy(linger=0)


async def test_loss_sums_that_overflow_abort_naming_the_ranks_and_write_result_json(tmp_path):
    import asyncio
    import json

    import zmq.asyncio

    from epochal.coordinator import Coordinator, CoordinatorConfig
    from epochal.errors import RunAborted
    from epochal.protocol import Abort, EpochReady, EpochReport, Go
    from tests.coordinator.test_service import join_all

    ctx = zmq.asyncio.Context()
    try:
        config = CoordinatorConfig(world_size=2, epochs=3, run_dir=tmp_path / "run")
        coordinator = Coordinator(config, context=ctx, log=lambda line: None)
        await coordinator.start()
        task = asyncio.create_task(coordinator.run())
        workers = await join_all(ctx, coordinator, 2)
        for w in workers:
            await w.send(EpochReady(epoch=0, train_batches=2, valid_batches=None))
        for w in workers:
            assert isinstance(await w.recv(), Go)
        for w in workers:  # each finite; their sum is not (fsum raised OverflowError)
            await w.send(EpochReport(0, 1.5e308, 1, 0.0, 0, ready=EpochReady(1, 2, None)))
        for w in workers:
            abort = await w.recv()
            assert isinstance(abort, Abort), abort
            assert "training loss sums of ranks 0-1" in abort.reason
        with pytest.raises(RunAborted, match="diverged"):
            await asyncio.wait_for(task, 5)
        result = json.loads((tmp_path / "run" / RESULT_FILE).read_text())
        assert result["status"] == "aborted"
        assert "ranks 0-1" in result["reason"]
    finally:
        ctx.destroy(linger=0)
