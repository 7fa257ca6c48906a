"""Reading a run directory back (epochal/coordinator/serve/resume.py), on synthetic run directories.

Each test writes what a run leaves behind, the way the service and the worker write it:
``run.json`` (``Coordinator.start``), one ``epochs.jsonl`` line per decided epoch
(``Coordinator._decide``: ``kind`` "epoch", the EpochOutcome's fields, ``validates``,
``checkpoint``, batch counts, timings) and per committed checkpoint (``kind`` "checkpoint"),
``result.json`` (``Coordinator._end``), and checkpoints ``epoch-NNNNNN/`` holding ``MANIFEST.json``
``{"format", "epoch", "files": {name: sha256}, "key_id", "hmac_sha256"}`` signed with the session's
checkpoint key (``epochal.rundir.manifest.write_manifest``, as ``Checkpointer.save`` writes it). The
expected loop state is a LoopState fed the same losses by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.rules.loop import LoopState
from epochal.coordinator.rules.outcome import EpochOutcome
from epochal.coordinator.rules.runstate import RunState, prunable
from epochal.coordinator.rules.schedule import parse_schedule
from epochal.coordinator.rules.steering import STEERS, steered_line
from epochal.coordinator.serve.resume import (
    config_record,
    differences,
    inspect,
    last_world_size,
    script_identity,
    start_fresh,
)
from epochal.errors import ConfigError
from epochal.rundir.checkpointkey import CheckpointKey, load_key
from epochal.rundir.manifest import checkpoint_path, signed, verify_checkpoint, write_manifest

SCHEDULE = "plateau:patience=0,factor=0.5,threshold=0"

# (train loss, validation loss or None): the run validates, epochs 1 and 5 were not validated
ROWS: list[tuple[float, float | None]] = [
    (2.0, 8.0),  # s 8 (before best_from: no best)
    (1.5, None),
    (1.2, 4.0),  # s 6: the best
    (1.0, 8.0),  # s 7: worse, patience count 1, plateau halves the factor
    (0.9, 2.0),  # s 4.5: the best
    (0.8, None),
]

CHECKPOINT_FILES = {
    ".metadata": b"dcp metadata",
    "__0_0.distcp": b"\x00\x01model and optimizer\xff" * 50,
    "rank00000.pt": b"rng of rank 0",
    "rank00001.pt": b"rng of rank 1",
}


def make_config(tmp_path: Path, **overrides: Any) -> CoordinatorConfig:
    fields: dict[str, Any] = {
        "world_size": 2,
        "epochs": 10,
        "smoothing": 0.5,
        "lr_schedule": SCHEDULE,
        "patience": 3,
        "best_from": 1,
        "run_dir": tmp_path / "run",
        "command": ("/work/train.py", "--lr", "0.1"),
        "script_digest": "ab" * 32,
    }
    fields.update(overrides)
    return CoordinatorConfig(**fields)


def hand_loop(epochs_done: int, *, epochs: int = 10) -> LoopState:
    """The loop state after ROWS[:epochs_done], built without resume.py."""
    state = LoopState(
        epochs=epochs,
        smoothing=0.5,
        schedule=parse_schedule(SCHEDULE, epochs),
        patience=3,
        min_delta=0.0,
        best_from=1,
    )
    for epoch, (train, valid) in enumerate(ROWS[:epochs_done]):
        state.update(epoch, train, valid, validates=True)
    return state


def write_checkpoint(checkpoint_dir: Path, epoch: int) -> Path:
    path = checkpoint_dir / f"epoch-{epoch:06d}"
    path.mkdir(parents=True)
    for name, data in CHECKPOINT_FILES.items():
        (path / name).write_bytes(data)
    write_manifest(path, epoch, load_key())
    return path


def verify(path: Path, epoch: int) -> str | None:
    return verify_checkpoint(path, load_key(), epoch=epoch)


def write_run(
    config: CoordinatorConfig,
    *,
    epochs_done: int,
    checkpoints: list[int],
    rows: list[tuple[float, float | None]] = ROWS,
    state: LoopState | None = None,
) -> list[dict[str, Any]]:
    """Write run.json, the journal and the checkpoints of a run that got this far; the records."""
    run_dir = config.run_dir
    assert run_dir is not None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(
        json.dumps(
            {
                "run_id": "0123456789ab",
                "endpoint": "tcp://127.0.0.1:40001",
                "host": "node-1",
                "pid": 4242,
                "started": 1700000000.0,
                "resumed_from": None,
                "config": config_record(config),
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    loop = state or hand_loop(0)
    records: list[dict[str, Any]] = []
    for epoch in range(epochs_done):
        train, valid = rows[epoch]
        outcome = loop.update(epoch, train, valid, validates=True)
        records.append(
            {
                "kind": "epoch",
                **asdict(outcome),
                "validates": True,
                "checkpoint": epoch in checkpoints,
                "train_batches": 4,
                "valid_batches": 0 if valid is None else 2,
                "seconds": 0.25,
                "time": 1700000001.0 + epoch,
            }
        )
        if epoch in checkpoints:
            write_checkpoint(config.checkpoint_path, epoch)
            records.append({"kind": "checkpoint", "epoch": epoch, "time": 1700000001.5 + epoch})
    write_journal(run_dir, records)
    return records


def write_journal(run_dir: Path, records: list[dict[str, Any]], tail: bytes = b"") -> None:
    lines = b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in records)
    (run_dir / "epochs.jsonl").write_bytes(lines + tail)


def look(config: CoordinatorConfig) -> RunState:
    return inspect(config, config.checkpoint_path)


def refusal(config: CoordinatorConfig) -> str:
    with pytest.raises(ConfigError) as info:
        look(config)
    return str(info.value)


# ----------------------------------------------------------------------------- a fresh start


def test_without_a_run_directory_the_run_starts_at_zero(tmp_path: Path):
    state = look(make_config(tmp_path, run_dir=None))
    assert (state.resume_epoch, state.start_epoch, state.finished) == (None, 0, None)
    assert (state.records, state.notes) == ([], [])
    assert state.loop == hand_loop(0)


def test_an_empty_run_directory_starts_at_zero(tmp_path: Path):
    config = make_config(tmp_path)
    config.run_dir.mkdir()
    state = look(config)
    assert (state.resume_epoch, state.start_epoch, state.records, state.notes) == (None, 0, [], [])
    assert state.loop == hand_loop(0)


def test_a_journal_without_run_json_is_refused_not_wiped(tmp_path: Path):
    # starting over here would rewrite epochs.jsonl empty: the run's history lost in silence
    config = make_config(tmp_path)
    write_run(config, epochs_done=4, checkpoints=[1, 3])
    (config.run_dir / "run.json").unlink()
    before = (config.run_dir / "epochs.jsonl").read_bytes()
    message = refusal(config)
    assert f"{config.run_dir / 'run.json'} is missing" in message
    assert "--fresh" in message
    assert (config.run_dir / "epochs.jsonl").read_bytes() == before


def test_an_empty_journal_without_run_json_is_a_fresh_start(tmp_path: Path):
    config = make_config(tmp_path)
    config.run_dir.mkdir()
    (config.run_dir / "epochs.jsonl").write_bytes(b"")
    assert look(config).start_epoch == 0


@pytest.mark.parametrize(("resume_epoch", "start"), [(None, 0), (0, 1), (4, 5)])
def test_start_epoch_is_the_one_after_the_resumed_checkpoint(resume_epoch: int | None, start: int):
    assert RunState(loop=hand_loop(0), resume_epoch=resume_epoch).start_epoch == start


# ----------------------------------------------------------------------------- resuming


def test_resume_at_the_newest_committed_checkpoint_with_the_loop_replayed(tmp_path: Path):
    config = make_config(tmp_path)
    records = write_run(config, epochs_done=5, checkpoints=[1, 3])
    state = look(config)
    assert (state.resume_epoch, state.start_epoch, state.finished) == (3, 4, None)
    assert state.notes == []
    # epoch 4 was decided but not checkpointed: it is dropped and will run again
    assert state.records == [r for r in records if r["epoch"] <= 3]
    assert [(r["kind"], r["epoch"]) for r in state.records] == [
        ("epoch", 0),
        ("epoch", 1),
        ("checkpoint", 1),
        ("epoch", 2),
        ("epoch", 3),
        ("checkpoint", 3),
    ]
    expected = hand_loop(4)
    assert state.loop == expected
    # what the replay must have rebuilt: smoothing, best epoch, patience and the plateau's factor
    assert (state.loop.smoothed, state.loop.best_epoch, state.loop.best_loss) == (7.0, 2, 6.0)
    assert (state.loop.stale, state.loop.lr_factor) == (1, 0.5)
    assert state.loop.schedule_state == {"best": 6.0, "bad": 0}
    assert [o.epoch for o in state.loop.history] == [0, 1, 2, 3]


def test_the_replayed_outcomes_equal_the_journaled_ones(tmp_path: Path):
    config = make_config(tmp_path)
    records = write_run(config, epochs_done=6, checkpoints=[5])
    state = look(config)
    fields = [f.name for f in dataclasses.fields(EpochOutcome)]
    journaled = [{k: r[k] for k in fields} for r in records if r["kind"] == "epoch"]
    assert [asdict(o) for o in state.loop.history] == journaled
    assert len(journaled) == 6


def test_a_resume_at_the_stopping_epoch_replays_the_stop(tmp_path: Path):
    # killed after the last checkpoint was journaled but before result.json: the replayed loop
    # says the run is over, which is what keeps the service from training another epoch
    config = make_config(tmp_path, epochs=4)
    write_run(config, epochs_done=4, checkpoints=[3], state=hand_loop(0, epochs=4))
    state = look(config)
    assert (state.resume_epoch, state.start_epoch, state.finished) == (3, 4, None)
    assert state.loop.history[-1].stop
    assert state.loop.history[-1].stop_reason == "epochs"


def test_a_resume_after_an_lr_factor_stop_keeps_the_factor_at_or_below_zero(tmp_path: Path):
    config = make_config(tmp_path, lr_schedule="linear:end=3")
    loop = LoopState(
        epochs=10,
        smoothing=0.5,
        schedule=parse_schedule("linear:end=3", 10),
        patience=3,
        best_from=1,
    )
    write_run(config, epochs_done=3, checkpoints=[2], state=loop)
    state = look(config)
    assert state.resume_epoch == 2
    assert state.loop.history[-1].stop_reason == "lr_factor"
    assert state.loop.lr_factor <= 0
    assert state.loop == loop


def test_a_committed_checkpoint_needs_a_journal_record_not_just_a_directory(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    write_checkpoint(config.checkpoint_path, 4)  # committed, not journaled
    assert look(config).resume_epoch == 3


def test_checkpoints_invisible_from_here_are_trusted_from_the_journal(tmp_path: Path):
    # the coordinator runs on another machine than the workers' shared disk
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    for path in sorted(config.checkpoint_path.iterdir()):
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    config.checkpoint_path.rmdir()
    state = look(config)
    assert (state.resume_epoch, state.notes) == (3, [])
    assert state.loop == hand_loop(4)


def test_a_custom_checkpoint_dir_is_where_checkpoints_are_verified(tmp_path: Path):
    config = make_config(tmp_path, checkpoint_dir=tmp_path / "shared" / "ckpt")
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    assert (tmp_path / "shared" / "ckpt" / "epoch-000003" / "MANIFEST.json").exists()
    (tmp_path / "shared" / "ckpt" / "epoch-000003" / "rank00001.pt").write_bytes(b"tampered")
    assert look(config).resume_epoch == 1


# ----------------------------------------------------------------------------- the journal


def test_a_half_written_last_line_is_ignored_with_a_note(tmp_path: Path):
    config = make_config(tmp_path)
    records = write_run(config, epochs_done=5, checkpoints=[1, 3])
    # the run was killed while journaling epoch 4's checkpoint (whose directory is complete)
    write_checkpoint(config.checkpoint_path, 4)
    write_journal(config.run_dir, records, tail=b'{"epoch": 4, "kind": "checkpo')
    state = look(config)
    assert state.resume_epoch == 3
    assert state.loop == hand_loop(4)
    assert len(state.notes) == 1
    assert "half-written last line" in state.notes[0]
    assert str(config.run_dir / "epochs.jsonl") in state.notes[0]


def test_a_complete_last_line_without_its_newline_is_kept(tmp_path: Path):
    config = make_config(tmp_path)
    records = write_run(config, epochs_done=5, checkpoints=[1, 3])
    write_checkpoint(config.checkpoint_path, 4)
    tail = json.dumps({"epoch": 4, "kind": "checkpoint", "time": 1.0}).encode()
    write_journal(config.run_dir, records, tail=tail)
    state = look(config)
    assert (state.resume_epoch, state.notes) == (4, [])
    assert state.loop == hand_loop(5)


@pytest.mark.parametrize(
    "bad",
    [
        b"not json at all",
        b'{"kind": "epoch", "epoch": 2',  # cut short, but more lines follow: not the last write
        b"[1, 2, 3]",
        b'"epoch"',
        b'{"kind": "note", "epoch": 1}',
        b'{"kind": "epoch"}',
        b'{"kind": "checkpoint", "epoch": "two"}',
        b'{"kind": "checkpoint", "epoch": null}',
        b"\xff\xfe\x00",
        # these passed the old line check and failed later with a raw KeyError or TypeError
        b'{"kind": "epoch", "epoch": 1}',
        b'{"kind": "epoch", "epoch": 1, "train_loss": "low", "valid_loss": null, '
        b'"validates": true}',
        b'{"kind": "epoch", "epoch": 1, "train_loss": 1.0, "valid_loss": [], "validates": true}',
        b'{"kind": "epoch", "epoch": 1, "train_loss": 1.0, "valid_loss": 1.0}',
        b'{"kind": "checkpoint", "epoch": 1.5}',
        b'{"kind": "checkpoint", "epoch": -1}',
        b'{"kind": "checkpoint", "epoch": true}',
    ],
)
def test_a_corrupt_line_in_the_middle_is_refused_naming_the_line_and_fresh(
    tmp_path: Path, bad: bytes
):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    journal = config.run_dir / "epochs.jsonl"
    lines = journal.read_bytes().split(b"\n")
    lines[3] = bad  # line 4 of 7
    journal.write_bytes(b"\n".join(lines))
    message = refusal(config)
    assert f"the journal {journal} is corrupt at line 4" in message
    assert "--fresh" in message


def test_a_corrupt_last_line_that_was_fully_written_is_refused(tmp_path: Path):
    # it ends with a newline, so the write completed: the file is damaged, not cut short
    config = make_config(tmp_path)
    records = write_run(config, epochs_done=5, checkpoints=[1, 3])
    write_journal(config.run_dir, records, tail=b"garbage\n")
    message = refusal(config)
    assert "corrupt at line 8" in message
    assert "--fresh" in message


def test_blank_lines_are_skipped_and_still_counted(tmp_path: Path):
    config = make_config(tmp_path)
    records = write_run(config, epochs_done=5, checkpoints=[1, 3])
    journal = config.run_dir / "epochs.jsonl"
    journal.write_bytes(b"\n" + journal.read_bytes().replace(b"\n", b"\n\n", 1))
    assert look(config).records == [r for r in records if r["epoch"] <= 3]
    journal.write_bytes(b"\n\nbroken\n" + journal.read_bytes())
    assert "corrupt at line 3" in refusal(config)


def test_an_empty_journal_starts_at_zero_without_a_note(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=0, checkpoints=[])
    state = look(config)
    assert (state.resume_epoch, state.records, state.notes) == (None, [], [])


# ----------------------------------------------------------------------------- run.json


@pytest.mark.parametrize(
    "content",
    ["", "{", "[]", '{"run_id": "x"}', "\x00"],
)
def test_an_unreadable_run_json_is_refused_naming_it_and_fresh(tmp_path: Path, content: str):
    config = make_config(tmp_path)
    write_run(config, epochs_done=2, checkpoints=[1])
    (config.run_dir / "run.json").write_text(content)
    message = refusal(config)
    assert str(config.run_dir / "run.json") in message
    assert "--fresh" in message


# Another tool's run.json in the directory (a config that is not an object) is refused clearly.
@pytest.mark.parametrize(
    "content", ['{"config": 3}', '{"config": null}', '{"config": "train.yaml"}', '{"config": [1]}']
)
def test_a_run_json_whose_config_is_not_an_object_is_refused(tmp_path: Path, content: str):
    config = make_config(tmp_path)
    write_run(config, epochs_done=2, checkpoints=[1])
    (config.run_dir / "run.json").write_text(content)
    message = refusal(config)
    assert str(config.run_dir / "run.json") in message


def test_the_stored_config_holds_no_token_and_paths_as_text(tmp_path: Path):
    config = make_config(tmp_path, token="s3cret", checkpoint_dir=tmp_path / "c")
    record = config_record(config)
    assert "token" not in record
    assert "s3cret" not in json.dumps(record)
    assert record["run_dir"] == str(tmp_path / "run")
    assert record["checkpoint_dir"] == str(tmp_path / "c")
    assert json.loads(json.dumps(record)) == record
    assert set(record) == {f.name for f in dataclasses.fields(CoordinatorConfig)} - {"token"}


# every setting, and whether a resume may change it: (new value, the phrase naming it) or None
REFUSED: dict[str, tuple[Any, str]] = {
    "command": (
        ("/work/train.py", "--lr", "0.2"),
        "the workers' command line is '/work/train.py --lr 0.2' now but "
        "'/work/train.py --lr 0.1' in the run",
    ),
    "script_digest": ("cd" * 32, f"the script's SHA-256 is {'cd' * 32!r} now but"),
    "epochs": (9, "--epochs is 9 now but 10 in the run"),
    "steps_per_epoch": (40, "--steps-per-epoch is 40 now but not set in the run"),
    "job": ("other", "--job is 'other' now but 'epochal' in the run"),
    "batch_policy": ("truncate", "--batch-policy is 'truncate' now but 'error' in the run"),
    "smoothing": (0.25, "--smoothing is 0.25 now but 0.5 in the run"),
    "validation_frequency": (2, "--validation-frequency is 2 now but 1 in the run"),
    "lr_schedule": (
        "exponential:gamma=0.5",
        f"--lr-schedule is 'exponential:gamma=0.5' now but {SCHEDULE!r} in the run",
    ),
    "best_from": (0, "--best-from is 0 now but 1 in the run"),
    "monitor": ("accuracy", "--monitor is 'accuracy' now but 'loss' in the run"),
    "monitor_mode": ("max", "--monitor-mode is 'max' now but 'min' in the run"),
    "restore_best": (False, "is False now but True in the run"),
    "checkpoint_dir": (
        "elsewhere",
        "--checkpoint-dir is '{tmp}/elsewhere' now but not set in the run",
    ),
}
# settings that only steer what comes next: (new value, what the resume says of the change)
STEERED: dict[str, tuple[Any, str]] = {
    "patience": (None, "patience: 3 -> not set from epoch 4"),
    "min_delta": (0.5, "min-delta: 0.0 -> 0.5 from epoch 4"),
    "checkpoint_every": (2, "checkpoint-every: 1 -> 2 from epoch 4"),
}
MAY_CHANGE: dict[str, Any] = {
    "run_dir": "moved",
    "token": "new-token",
    "rendezvous_timeout": 5.0,
    "store_timeout": 5.0,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 3.0,
    "finish_timeout": 2.0,
    "backend": "gloo",
    "keep_checkpoints": 7,
    "stall_timeout": 60.0,
    "stall_abort": 30.0,
    "tensorboard": "tb",
    "metrics_address": "127.0.0.1:9400",
    "status": False,
    "min_workers": 2,
    "replica_check": False,
    "world_size": 3,  # the resume says so (recording's resume line), the checkpoint resharded
    "keep_schedule": True,  # what it keeps is recorded when the run is given more epochs
}


def test_every_setting_is_either_refused_or_allowed_to_change():
    names = {f.name for f in dataclasses.fields(CoordinatorConfig)}
    assert set(REFUSED) | set(MAY_CHANGE) | set(STEERED) == names
    assert not set(REFUSED) & set(MAY_CHANGE)
    assert set(STEERED) == STEERS


def changed(tmp_path: Path, name: str, value: Any) -> CoordinatorConfig:
    if name in ("run_dir", "checkpoint_dir"):
        value = tmp_path / value
    return make_config(tmp_path, **{name: value})


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_changed_setting_is_refused_naming_the_flag_and_both_values(tmp_path: Path, name: str):
    value, phrase = REFUSED[name]
    original = make_config(tmp_path)
    write_run(original, epochs_done=2, checkpoints=[1])
    message = refusal(changed(tmp_path, name, value))
    assert phrase.format(tmp=tmp_path) in message
    assert f"the run directory {original.run_dir} holds a run with other settings" in message
    assert "--fresh" in message


def test_several_changed_settings_are_all_named(tmp_path: Path):
    write_run(make_config(tmp_path), epochs_done=2, checkpoints=[1])
    message = refusal(make_config(tmp_path, epochs=9, smoothing=1.0, best_from=0))
    assert "--epochs is 9 now but 10 in the run" in message
    assert "--smoothing is 1.0 now but 0.5 in the run" in message
    assert "--best-from is 0 now but 1 in the run" in message


# The message names the flag that exists on the command line (--no-restore-best).
def test_a_changed_restore_best_names_the_flag_that_exists(tmp_path: Path):
    write_run(make_config(tmp_path), epochs_done=2, checkpoints=[1])
    message = refusal(make_config(tmp_path, restore_best=False))
    assert "--no-restore-best" in message


@pytest.mark.parametrize("name", sorted(MAY_CHANGE))
def test_a_setting_a_resume_may_change_is_let_change(tmp_path: Path, name: str):
    original = make_config(tmp_path)
    write_run(original, epochs_done=5, checkpoints=[1, 3])
    current = changed(tmp_path, name, MAY_CHANGE[name])
    if name == "run_dir":  # the directory was moved: run.json still names the old path
        original.run_dir.rename(current.run_dir)
        assert json.loads((current.run_dir / "run.json").read_text())["config"]["run_dir"] == str(
            original.run_dir
        )
    state = look(current)
    assert state.resume_epoch == 3
    assert state.notes == []


@pytest.mark.parametrize("name", sorted(STEERED))
def test_a_setting_that_steers_what_comes_next_may_change_and_is_said(tmp_path: Path, name: str):
    write_run(make_config(tmp_path), epochs_done=5, checkpoints=[1, 3])
    value, said = STEERED[name]
    state = look(make_config(tmp_path, **{name: value}))
    assert state.resume_epoch == 3
    assert [steered_line(c) for c in state.steered_now] == [said]
    assert state.steered == state.steered_now
    assert state.carry is None  # running workers go on as decided: they start again instead


def test_a_patience_set_on_resume_says_not_set_and_applies_from_the_resumed_epoch(tmp_path: Path):
    original = make_config(tmp_path, patience=None)
    records = write_run(original, epochs_done=6, checkpoints=[1, 3, 5])
    state = look(make_config(tmp_path, patience=0))
    assert [steered_line(c) for c in state.steered_now] == ["patience: not set -> 0 from epoch 6"]
    # the epochs already decided are replayed as they were decided, without early stopping:
    # under patience 0, epoch 3 (no improvement) would have stopped the run
    decided = [r for r in records if r["kind"] == "epoch"]
    assert [o.stop for o in state.loop.history] == [r["stop"] for r in decided] == [False] * 6
    assert state.loop.patience == 0  # and it steers every epoch from 6 on


def test_changes_of_earlier_resumes_are_kept_and_replayed(tmp_path: Path):
    # started without patience, resumed at epoch 4 with --patience 0, now at 6 with 4
    write_run(make_config(tmp_path, patience=0), epochs_done=6, checkpoints=[1, 3, 5])
    run_json = tmp_path / "run" / "run.json"
    run = json.loads(run_json.read_text())
    run["steered"] = [{"setting": "patience", "from": None, "to": 0, "at_epoch": 4}]
    run_json.write_text(json.dumps(run))
    again = look(make_config(tmp_path, patience=4))
    assert [steered_line(c) for c in again.steered] == [
        "patience: not set -> 0 from epoch 4",
        "patience: 0 -> 4 from epoch 6",
    ]
    # epoch 3 (no improvement) was decided without patience: patience 0 would have stopped it
    assert [o.stop for o in again.loop.history] == [False] * 6
    assert again.loop.patience == 4


def test_a_change_made_by_a_resume_whose_epochs_are_redone_no_longer_stands(tmp_path: Path):
    write_run(make_config(tmp_path, patience=0), epochs_done=4, checkpoints=[1, 3])
    run_json = tmp_path / "run" / "run.json"
    run = json.loads(run_json.read_text())
    run["steered"] = [{"setting": "patience", "from": None, "to": 0, "at_epoch": 4}]
    run_json.write_text(json.dumps(run))
    again = look(make_config(tmp_path, patience=4))
    assert [steered_line(c) for c in again.steered] == ["patience: not set -> 4 from epoch 4"]
    assert [o.stop for o in again.loop.history] == [False] * 4


@pytest.mark.parametrize(
    ("stored", "current", "expected"),
    [
        ({"epochs": 5}, {"epochs": 5}, []),
        ({"epochs": 5}, {"epochs": 9}, []),  # more epochs train the run further
        (
            {"epochs": 9},
            {"epochs": 5},
            ["--epochs is 5 now but 9 in the run (a run may be given more, never fewer)"],
        ),
        ({"smoothing": 1}, {"smoothing": 1.0}, []),  # JSON may hand back an int for a float
        ({"token": "a", "backend": "nccl"}, {"token": "b", "backend": "gloo"}, []),
        ({}, {"best_from": 2}, ["--best-from is 2 now but not set in the run"]),
        ({"old_setting": 1}, {}, ["--old-setting is not set now but 1 in the run"]),
        ({"patience": None}, {"patience": 5}, []),  # it steers what comes next: steered()
        (
            {"checkpoint_dir": None},
            {"checkpoint_dir": "/ck"},
            ["--checkpoint-dir is '/ck' now but not set in the run"],
        ),
        ({"world_size": 2}, {"world_size": 4}, []),  # a resume at another size
        (
            {"smoothing": 0.5, "epochs": 6},
            {"smoothing": 0.9, "epochs": 5},
            [
                "--epochs is 5 now but 6 in the run (a run may be given more, never fewer)",
                "--smoothing is 0.9 now but 0.5 in the run",
            ],
        ),
    ],
)
def test_differences(stored: dict[str, Any], current: dict[str, Any], expected: list[str]):
    assert differences(stored, current) == expected


def test_the_last_world_size_is_the_last_epoch_records():
    # the resume line names a change of size from it
    records: list[dict[str, Any]] = [
        {"kind": "epoch", "epoch": 0, "world_size": 4},
        {"kind": "checkpoint", "epoch": 0},
        {"kind": "world", "epoch": 1, "from": 4, "to": 3},
        {"kind": "epoch", "epoch": 1, "world_size": 3},
        {"kind": "checkpoint", "epoch": 1},
    ]
    assert last_world_size(records) == 3
    assert last_world_size(records[:2]) == 4
    assert last_world_size([]) is None
    assert last_world_size([{"kind": "epoch", "epoch": 0}]) is None  # an older journal


# ----------------------------------------------------------------------------- result.json


def test_a_finished_run_is_reported_finished_and_not_replayed(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=6, checkpoints=[5])
    result = {
        "status": "finished",
        "run_id": "0123456789ab",
        "best_epoch": 4,
        "best_loss": 4.5,
        "epochs_run": 6,
    }
    (config.run_dir / "result.json").write_text(json.dumps(result, indent=2))
    state = look(config)
    assert state.finished == result
    assert (state.resume_epoch, state.records) == (None, [])


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({"status": "aborted", "run_id": "x", "reason": "rank 1 died"}),
        "{",  # a half-written result: not a finished run
        json.dumps({"run_id": "x"}),
    ],
)
def test_a_result_that_is_not_finished_resumes(tmp_path: Path, content: str):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    (config.run_dir / "result.json").write_text(content)
    state = look(config)
    assert (state.finished, state.resume_epoch) == (None, 3)


def test_a_finished_run_with_other_settings_is_still_refused(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=2, checkpoints=[1])
    (config.run_dir / "result.json").write_text('{"status": "finished"}')
    assert "--epochs is 3 now" in refusal(make_config(tmp_path, epochs=3))


# ----------------------------------------------------------------------------- more epochs


def write_finished(config: CoordinatorConfig, epochs_run: int) -> None:
    result = {"status": "finished", "run_id": "0123456789ab", "epochs_run": epochs_run}
    (config.run_dir / "result.json").write_text(json.dumps(result))


def test_a_finished_run_given_more_epochs_resumes_after_its_last_epoch(tmp_path: Path):
    before = make_config(tmp_path, epochs=4)
    write_run(before, epochs_done=4, checkpoints=[1, 3], state=hand_loop(0, epochs=4))
    write_finished(before, 4)
    state = look(make_config(tmp_path, epochs=6))
    assert (state.finished, state.resume_epoch, state.start_epoch) == (None, 3, 4)
    assert state.extended_from == 4
    assert state.extensions == [
        {"from_epochs": 4, "to_epochs": 6, "at_epoch": 4, "had_finished": True}
    ]
    # the journal replayed under the new count: epoch 3 no longer stops the run, and the smoothed
    # loss, best epoch, factor and patience are those of a run started with 6 epochs
    assert not state.loop.history[-1].stop
    assert state.loop == hand_loop(4, epochs=6)
    assert [r["epoch"] for r in state.records] == [0, 1, 1, 2, 3, 3]


def test_an_unfinished_run_given_more_epochs_resumes_as_always(tmp_path: Path):
    write_run(make_config(tmp_path), epochs_done=5, checkpoints=[1, 3])
    state = look(make_config(tmp_path, epochs=12))
    assert (state.resume_epoch, state.extended_from) == (3, 10)
    assert state.extensions == [
        {"from_epochs": 10, "to_epochs": 12, "at_epoch": 4, "had_finished": False}
    ]
    assert state.loop == hand_loop(4, epochs=12)


def cosine_loop(epochs: int) -> LoopState:
    return LoopState(epochs=epochs, schedule=parse_schedule("cosine", epochs))


def test_a_cosine_run_given_more_epochs_says_how_its_factor_jumps(tmp_path: Path):
    before = make_config(tmp_path, epochs=8, lr_schedule="cosine")
    write_run(before, epochs_done=6, checkpoints=[5], state=cosine_loop(8))
    state = look(make_config(tmp_path, epochs=14, lr_schedule="cosine"))
    old = cosine_loop(8)
    new = cosine_loop(14)
    for epoch, (train, valid) in enumerate(ROWS[:6]):
        old.update(epoch, train, valid, validates=True)
        new.update(epoch, train, valid, validates=True)
    assert new.lr_factor > 2 * old.lr_factor  # the jump said
    assert (
        f"learning-rate factor {old.lr_factor:.4g} -> {new.lr_factor:.4g} at epoch 6: the "
        "cosine:min=0 schedule spans --epochs, now 14 where it was 8, so the run continues on "
        "the curve over the new count"
    ) in state.notes


FALLING = [(1.0 / (epoch + 1), 1.0 / (epoch + 1)) for epoch in range(14)]
"""Losses that improve every epoch: nothing stops a run early."""


def test_keep_schedule_holds_the_last_factor_of_the_curve_the_run_had(tmp_path: Path):
    before = make_config(tmp_path, epochs=8, lr_schedule="cosine")
    write_run(before, epochs_done=8, checkpoints=[7], rows=FALLING, state=cosine_loop(8))
    write_finished(before, 8)
    state = look(make_config(tmp_path, epochs=14, lr_schedule="cosine", keep_schedule=True))
    last = (1 + math.cos(math.pi * 7 / 8)) / 2  # what epoch 7, the last of 8, trained with
    assert state.start_epoch == 8 and state.loop.lr_factor == pytest.approx(last)
    assert state.extensions[-1]["kept_span"] == 8
    assert (
        f"learning-rate factor 0 -> {last:.4g} at epoch 8: the cosine:min=0 schedule spans "
        "--epochs, now 14 where it was 8, so the run keeps its curve over 8 epochs "
        "(--keep-schedule) and holds its last factor for the epochs added"
    ) in state.notes
    # the factor holds for the epochs added
    loop = state.loop
    for epoch in range(8, 13):
        loop.update(epoch, 0.01, 0.01, validates=True)
        assert loop.lr_factor == pytest.approx(last)


def test_a_later_resume_of_a_run_that_kept_its_schedule_keeps_it(tmp_path: Path):
    # the run above, killed in epoch 11 after the checkpoint of epoch 10; resumed with neither
    # --keep-schedule nor more epochs, it goes on with the factor it held
    kept = make_config(tmp_path, epochs=14, lr_schedule="cosine", keep_schedule=True)
    held = LoopState(
        epochs=14, schedule=dataclasses.replace(parse_schedule("cosine", 8), held=True)
    )
    write_run(kept, epochs_done=11, checkpoints=[7, 10], rows=FALLING, state=held)
    extended = {"from_epochs": 8, "to_epochs": 14, "at_epoch": 8, "kept_span": 8}
    run = json.loads((kept.run_dir / "run.json").read_text())
    (kept.run_dir / "run.json").write_text(json.dumps({**run, "extended": [extended]}))
    state = look(make_config(tmp_path, epochs=14, lr_schedule="cosine"))
    assert state.start_epoch == 11 and state.notes == []
    assert state.loop.lr_factor == pytest.approx((1 + math.cos(math.pi * 7 / 8)) / 2)
    # given more epochs again without --keep-schedule, it continues on the curve over 20
    state = look(make_config(tmp_path, epochs=20, lr_schedule="cosine"))
    assert "kept_span" not in state.extensions[-1]
    assert state.loop.lr_factor == pytest.approx((1 + math.cos(math.pi * 11 / 20)) / 2)


def test_a_schedule_that_does_not_span_the_epochs_says_nothing_when_given_more(tmp_path: Path):
    write_run(make_config(tmp_path), epochs_done=5, checkpoints=[1, 3])
    assert look(make_config(tmp_path, epochs=12)).notes == []


def test_earlier_extensions_are_kept(tmp_path: Path):
    before = make_config(tmp_path, epochs=4)
    write_run(before, epochs_done=4, checkpoints=[3], state=hand_loop(0, epochs=4))
    earlier = {"from_epochs": 2, "to_epochs": 4, "at_epoch": 2, "had_finished": True}
    run = json.loads((before.run_dir / "run.json").read_text())
    (before.run_dir / "run.json").write_text(json.dumps({**run, "extended": [earlier]}))
    write_finished(before, 4)
    assert look(make_config(tmp_path, epochs=5)).extensions == [
        earlier,
        {"from_epochs": 4, "to_epochs": 5, "at_epoch": 4, "had_finished": True},
    ]
    assert look(before).extensions == [earlier]  # finished, nothing to train: as it was


def test_fewer_epochs_are_refused_naming_both(tmp_path: Path):
    before = make_config(tmp_path, epochs=4)
    write_run(before, epochs_done=4, checkpoints=[3], state=hand_loop(0, epochs=4))
    write_finished(before, 4)
    message = refusal(make_config(tmp_path, epochs=3))
    assert "--epochs is 3 now but 4 in the run (a run may be given more, never fewer)" in message


def test_a_run_that_stopped_early_is_not_given_more_epochs(tmp_path: Path):
    config = make_config(tmp_path, lr_schedule="linear:end=3")
    loop = LoopState(
        epochs=10,
        smoothing=0.5,
        schedule=parse_schedule("linear:end=3", 10),
        patience=3,
        best_from=1,
    )
    write_run(config, epochs_done=3, checkpoints=[2], state=loop)
    write_finished(config, 3)
    message = refusal(make_config(tmp_path, lr_schedule="linear:end=3", epochs=20))
    assert f"the run in {config.run_dir} finished after 3 of its 10 epochs" in message
    assert "its learning-rate factor reached 0" in message and "--fresh" in message


def test_a_finished_run_without_a_usable_checkpoint_is_not_given_more_epochs(tmp_path: Path):
    # starting it over from epoch 0 would rewrite its journal: the finished run lost in silence
    before = make_config(tmp_path, epochs=4)
    write_run(before, epochs_done=4, checkpoints=[3], state=hand_loop(0, epochs=4))
    write_finished(before, 4)
    damage_newest(checkpoint_path(before.checkpoint_path, 3), "flipped")
    journal = (before.run_dir / "epochs.jsonl").read_bytes()
    message = refusal(make_config(tmp_path, epochs=6))
    assert "finished, but it kept no usable checkpoint to train it further from" in message
    assert "the checkpoint of epoch 3 is unusable" in message and "--fresh" in message
    assert (before.run_dir / "epochs.jsonl").read_bytes() == journal


# ----------------------------------------------------------------------------- damaged checkpoints


def damage_newest(path: Path, how: str) -> None:
    match how:
        case "flipped":
            data = bytearray((path / "__0_0.distcp").read_bytes())
            data[10] ^= 1
            (path / "__0_0.distcp").write_bytes(bytes(data))
        case "truncated":
            (path / "__0_0.distcp").write_bytes((path / "__0_0.distcp").read_bytes()[:-1])
        case "file missing":
            (path / "rank00001.pt").unlink()
        case "manifest missing":
            (path / "MANIFEST.json").unlink()
        case "manifest unreadable":
            (path / "MANIFEST.json").write_text('{"epoch": 3, "files": {')
        case "manifest without files":
            (path / "MANIFEST.json").write_text('{"epoch": 3}')
        case "directory missing":
            for f in path.iterdir():
                f.unlink()
            path.rmdir()


DAMAGE = {
    "flipped": "__0_0.distcp does not match its manifest (corrupt, truncated or replaced)",
    "truncated": "__0_0.distcp does not match its manifest (corrupt, truncated or replaced)",
    "file missing": "rank00001.pt is unreadable",
    "manifest missing": "MANIFEST.json is missing",
    "manifest unreadable": "MANIFEST.json is unreadable",
    "manifest without files": "MANIFEST.json has no MAC",
    "directory missing": "MANIFEST.json is missing",
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_note(
    tmp_path: Path, how: str
):
    config = make_config(tmp_path)
    records = write_run(config, epochs_done=5, checkpoints=[1, 3])
    newest = checkpoint_path(config.checkpoint_path, 3)
    damage_newest(newest, how)
    assert verify(newest, 3) is not None
    state = look(config)
    assert (state.resume_epoch, state.start_epoch) == (1, 2)
    assert state.records == [r for r in records if r["epoch"] <= 1]
    assert state.loop == hand_loop(2)
    assert len(state.notes) == 1
    note = state.notes[0]
    assert note.startswith("the checkpoint of epoch 3 is unusable: ")
    assert DAMAGE[how] in note
    assert note.endswith("falling back to the previous one")


# ----------------------------------------------------------------------------- forged checkpoints


def forge(path: Path, manifest: dict[str, Any]) -> None:
    """Swap a file and recompute its sum in the manifest, as someone without the key can."""
    (path / "rank00001.pt").write_bytes(b"a pickle that runs a command")
    manifest["files"]["rank00001.pt"] = hashlib.sha256(b"a pickle that runs a command").hexdigest()
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_forged_checkpoint_with_a_recomputed_manifest_falls_back_naming_the_manifest(
    tmp_path: Path,
):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    newest = checkpoint_path(config.checkpoint_path, 3)
    forge(newest, json.loads((newest / "MANIFEST.json").read_text()))
    state = look(config)
    assert state.resume_epoch == 1
    (note,) = state.notes
    assert f"{newest / 'MANIFEST.json'} does not verify under the checkpoint key id " in note
    assert note.endswith("falling back to the previous one")


def test_a_checkpoint_signed_with_another_key_falls_back_naming_both_keys(tmp_path: Path):
    # a checkpoint copied from another user's run: signed, but not with this user's key
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    newest = checkpoint_path(config.checkpoint_path, 3)
    theirs = CheckpointKey(secret=bytes(range(32)), path=tmp_path / "their.key")
    (newest / "MANIFEST.json").unlink()
    write_manifest(newest, 3, theirs)
    state = look(config)
    assert state.resume_epoch == 1
    (note,) = state.notes
    assert f"signed with another checkpoint key (id '{theirs.key_id}')" in note
    assert load_key().describe() in note


def test_a_checkpoint_from_before_authentication_is_refused_saying_so(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    for epoch in (1, 3):  # the unsigned manifest epochal wrote before
        path = checkpoint_path(config.checkpoint_path, epoch)
        files = json.loads((path / "MANIFEST.json").read_text())["files"]
        (path / "MANIFEST.json").write_text(json.dumps({"epoch": epoch, "files": files}))
    state = look(config)
    assert state.resume_epoch is None
    assert all("predates authenticated checkpoints" in n for n in state.notes[:2])
    assert state.notes[2] == "no usable checkpoint: the run starts again from epoch 0"


def test_a_checkpoint_copied_from_another_epoch_is_refused(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    newest, older = (checkpoint_path(config.checkpoint_path, e) for e in (3, 1))
    for f in older.iterdir():
        (newest / f.name).write_bytes(f.read_bytes())
    state = look(config)
    assert state.resume_epoch == 1
    assert "belongs to epoch 1, not 3: the checkpoint was moved or copied" in state.notes[0]


def test_no_key_is_needed_for_checkpoints_this_machine_cannot_see(tmp_path: Path, monkeypatch):
    config = make_config(tmp_path, checkpoint_dir=tmp_path / "elsewhere")
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    for path in sorted(config.checkpoint_path.iterdir()):
        for f in path.iterdir():
            f.unlink()
        path.rmdir()
    config.checkpoint_path.rmdir()
    monkeypatch.setenv("EPOCHAL_CHECKPOINT_KEY_FILE", str(tmp_path / "no-such.key"))
    assert look(config).resume_epoch == 3


def test_a_missing_key_file_named_by_the_variable_stops_the_resume_with_one_line(
    tmp_path: Path, monkeypatch
):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    monkeypatch.setenv("EPOCHAL_CHECKPOINT_KEY_FILE", str(tmp_path / "no-such.key"))
    message = refusal(config)
    assert f"EPOCHAL_CHECKPOINT_KEY_FILE={tmp_path / 'no-such.key'} does not exist" in message
    assert "\n" not in message


def test_a_checkpoint_directory_others_may_write_is_refused(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    config.checkpoint_path.chmod(0o777)
    message = refusal(config)
    assert f"refusing the checkpoint directory: {config.checkpoint_path} is writable by others" in (
        message
    )
    assert "\n" not in message


def test_no_usable_checkpoint_starts_from_zero_with_a_note(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    damage_newest(checkpoint_path(config.checkpoint_path, 3), "flipped")
    damage_newest(checkpoint_path(config.checkpoint_path, 1), "manifest missing")
    state = look(config)
    assert (state.resume_epoch, state.start_epoch, state.records) == (None, 0, [])
    assert state.loop == hand_loop(0)
    assert [n.split(":")[0] for n in state.notes[:2]] == [
        "the checkpoint of epoch 3 is unusable",
        "the checkpoint of epoch 1 is unusable",
    ]
    assert state.notes[2] == "no usable checkpoint: the run starts again from epoch 0"
    assert len(state.notes) == 3


def test_a_journal_without_any_checkpoint_starts_from_zero_with_a_note(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=3, checkpoints=[])
    state = look(config)
    assert (state.resume_epoch, state.start_epoch, state.records) == (None, 0, [])
    assert state.notes == ["no usable checkpoint: the run starts again from epoch 0"]


def test_verify_accepts_a_checkpoint_that_matches_its_manifest(tmp_path: Path):
    assert verify(write_checkpoint(tmp_path, 7), 7) is None


def test_verify_accepts_files_in_subdirectories(tmp_path: Path):
    path = tmp_path / "epoch-000002"
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "shard").write_bytes(b"abc")
    write_manifest(path, 2, load_key())
    assert verify(path, 2) is None
    (path / "sub" / "shard").write_bytes(b"abd")
    assert "does not match its manifest" in (verify(path, 2) or "")


# A manifest whose "files" is not an object is a problem to report, and to fall back from, even
# when it is signed.
@pytest.mark.parametrize("files", ["[]", "null", '"MANIFEST.json"', '{"../run.json": "00"}'])
def test_a_manifest_whose_files_is_not_an_object_is_reported_not_raised(tmp_path: Path, files: str):
    path = write_checkpoint(tmp_path, 3)
    body = {"format": 2, "epoch": 3, "files": json.loads(files), "key_id": load_key().key_id}
    (path / "MANIFEST.json").write_text(json.dumps(signed(body, load_key())))
    problem = verify(path, 3)
    assert problem is not None and "MANIFEST.json" in problem


# ----------------------------------------------------------------------------- pruning


@pytest.mark.parametrize(
    ("committed", "keep", "best", "expected"),
    [
        ([0, 1, 2, 3], 2, None, [0, 1]),
        ([0, 1, 2, 3], 2, 0, [1]),  # the best is kept however old
        ([0, 1, 2, 3], 2, 3, [0, 1]),  # the best among the newest: nothing extra kept
        ([0, 1, 2, 3], 1, 1, [0, 2]),
        ([0, 1, 2, 3], 4, None, []),
        ([0, 1, 2], 5, 0, []),
        ([5], 1, None, []),
        ([5], 1, 5, []),
        ([], 2, None, []),
        ([3, 0, 2, 1], 2, None, [0, 1]),  # order does not matter
        ([1, 1, 2, 3, 3], 2, None, [1]),  # nor repeats
        ([0, 2, 4, 6, 8], 2, 2, [0, 4]),
        ([0, 1, 2], 2, 7, [0]),  # a best without a checkpoint changes nothing
    ],
)
def test_prunable_keeps_the_newest_n_and_the_best(
    committed: list[int], keep: int, best: int | None, expected: list[int]
):
    assert prunable(committed, keep, best) == expected


@pytest.mark.parametrize(
    ("epoch", "name"),
    [
        (0, "epoch-000000"),
        (7, "epoch-000007"),
        (123456, "epoch-123456"),
        (1234567, "epoch-1234567"),
    ],
)
def test_checkpoint_path_matches_the_workers_layout(tmp_path: Path, epoch: int, name: str):
    assert checkpoint_path(tmp_path, epoch) == tmp_path / name


# ----------------------------------------------------------------------------- starting over


def test_start_fresh_forgets_the_run_but_nothing_else(tmp_path: Path):
    config = make_config(tmp_path)
    write_run(config, epochs_done=5, checkpoints=[1, 3])
    run_dir = config.run_dir
    assert run_dir is not None
    (run_dir / "result.json").write_text('{"status": "finished"}')
    (run_dir / "notes.txt").write_text("mine")
    start_fresh(config, config.checkpoint_path)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert not config.checkpoint_path.exists()
    state = look(config)
    assert (state.resume_epoch, state.start_epoch, state.notes) == (None, 0, [])


def test_start_fresh_removes_a_checkpoint_dir_outside_the_run_dir(tmp_path: Path):
    config = make_config(tmp_path, checkpoint_dir=tmp_path / "ckpt")
    write_run(config, epochs_done=2, checkpoints=[1])
    assert (tmp_path / "ckpt" / "epoch-000001").exists()
    start_fresh(config, config.checkpoint_path)
    assert not (tmp_path / "ckpt").exists()
    assert not (tmp_path / "run" / "run.json").exists()


def test_start_fresh_on_nothing_is_a_no_op(tmp_path: Path):
    start_fresh(make_config(tmp_path, run_dir=None), None)
    config = make_config(tmp_path)
    config.run_dir.mkdir()
    start_fresh(config, config.checkpoint_path)  # no files, no checkpoint dir: nothing to do
    assert list(config.run_dir.iterdir()) == []


def test_start_fresh_lets_a_run_with_other_settings_begin(tmp_path: Path):
    write_run(make_config(tmp_path), epochs_done=2, checkpoints=[1])
    other = make_config(tmp_path, epochs=3)
    start_fresh(other, other.checkpoint_path)
    assert look(other).start_epoch == 0


@pytest.mark.parametrize("name", ["command", "script_digest"])
def test_an_unknown_command_is_not_compared(tmp_path: Path, name: str):
    # workers started by hand (a standalone coordinator) have no command the coordinator knows
    write_run(make_config(tmp_path / "a", **{name: None}), epochs_done=2, checkpoints=[1])
    known = make_config(tmp_path / "a")
    assert inspect(known, known.checkpoint_path).resume_epoch == 1
    write_run(make_config(tmp_path / "b"), epochs_done=2, checkpoints=[1])
    unknown = make_config(tmp_path / "b", **{name: None})
    assert inspect(unknown, unknown.checkpoint_path).resume_epoch == 1


def test_the_script_identity_is_its_absolute_path_arguments_and_digest(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("print('a')\n")
    first = script_identity(str(script), ["--seed", "1"], module=False)
    assert first["command"] == (str(script.resolve()), "--seed", "1")
    script.write_text("print('b')\n")
    assert script_identity(str(script), ["--seed", "1"], module=False) != first
    assert script_identity("pkg.train", ["-x"], module=True) == {
        "command": ("-m", "pkg.train", "-x"),
        "script_digest": None,
    }
