"""Each option is declared once, on its CoordinatorConfig field; the CLI and the guide follow it.

The options table of the guide's command-line page (docs/cli.md) is compared with the rows
rendered from the fields, so that a default or a meaning changed in one place and not the other
fails here, naming the row to write.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from epochal.cli.parser import _config, build_parser, run_options
from epochal.cli.settings import GROUPS, SETTING, Flag, Option, field_options, settings
from epochal.coordinator.config import CoordinatorConfig

CLI_PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
TABLE_HEAD = "| option | default | meaning |\n| --- | --- | --- |\n"


def table_rows() -> list[str]:
    text = CLI_PAGE.read_text(encoding="utf-8")
    start = text.index(TABLE_HEAD) + len(TABLE_HEAD)
    return text[start:].split("\n\n", 1)[0].splitlines()


def test_every_config_field_is_documented_once_in_its_metadata():
    for field in dataclasses.fields(CoordinatorConfig):
        spec = field.metadata.get(SETTING)
        assert spec is not None, f"{field.name} has no setting(...) in its metadata"
        assert spec.help and not spec.help.endswith("."), field.name
        if spec.flag is not None:
            assert spec.flag.group in GROUPS, field.name


def test_the_guides_options_table_is_the_one_the_fields_render():
    rows = table_rows()
    expected = [option.row() for option in run_options()]
    for got, want in zip(rows, expected, strict=False):
        assert got == want, f"docs/cli.md options table: write\n{want}\ninstead of\n{got}"
    assert rows[: len(expected)] == expected, (
        "docs/cli.md options table: rows missing:\n" + "\n".join(expected[len(rows) :])
    )


def test_the_guides_rows_after_the_shared_ones_name_coordinator_flags():
    rows = table_rows()[len(run_options()) :]
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    coordinator_flags = set(sub.choices["coordinator"]._option_string_actions)
    shared = {option.flag for option in run_options()}
    assert rows, "the coordinator-only options are missing from the docs/cli.md table"
    for row in rows:
        flags = re.findall(r"`(--[a-z-]+)", row.split("|")[1])
        assert flags, row
        for flag in flags:
            assert flag in coordinator_flags and flag not in shared, row


@pytest.mark.parametrize("command", [["run", "--nproc", "2", "s.py"], ["coordinator"]])
def test_the_generated_flags_default_to_the_fields_defaults(command: list[str]):
    argv = command if command[0] == "run" else [*command, "--world-size", "2"]
    args = build_parser().parse_args(argv)
    config = _config(args, 2, "t", "RUN")
    assert config == CoordinatorConfig(world_size=2, token="t", run_dir=Path("runs") / "RUN")
    assert args.fresh is False and args.max_restarts == 0


def test_every_flag_reaches_its_field():
    values = {
        "epochs": ("7", 7),
        "steps_per_epoch": ("50", 50),
        "job": ("exp", "exp"),
        "batch_policy": ("truncate", "truncate"),
        "smoothing": ("0.5", 0.5),
        "validation_frequency": ("2", 2),
        "lr_schedule": ("exponential:gamma=0.5", "exponential:gamma=0.5"),
        "patience": ("3", 3),
        "min_delta": ("0.1", 0.1),
        "best_from": ("1", 1),
        "monitor": ("accuracy", "accuracy"),
        "monitor_mode": ("max", "max"),
        "backend": ("gloo", "gloo"),
        "checkpoint_every": ("0", 0),
        "keep_checkpoints": ("4", 4),
        "checkpoint_dir": ("ck", Path("ck")),
        "run_dir": ("rd", Path("rd")),
        "rendezvous_timeout": ("5", 5.0),
        "heartbeat_interval": ("0.5", 0.5),
        "heartbeat_timeout": ("3", 3.0),
        "stall_timeout": ("9", 9.0),
        "stall_abort": ("0", None),
        "tensorboard": ("tb", Path("tb")),
        "metrics_address": ("127.0.0.1:9400", "127.0.0.1:9400"),
        "min_workers": ("2", 2),
    }
    options = {o.dest: o for o in field_options(CoordinatorConfig)}
    assert set(options) == {*values, "restore_best", "status", "replica_check", "keep_schedule"}
    argv = ["run", "--nproc", "2", "--no-restore-best", "--no-status", "--no-replica-check"]
    argv.append("--keep-schedule")  # a switch that is off unless given
    for name, (text, _) in values.items():
        argv += [options[name].flag, text]
    config = _config(build_parser().parse_args([*argv, "s.py"]), 2, "", "RUN")
    assert config.restore_best is False and config.status is False
    assert config.replica_check is False and config.keep_schedule is True
    for name, (_, value) in values.items():
        assert getattr(config, name) == value, name


def test_the_resume_policy_is_read_from_the_fields():
    specs = settings(CoordinatorConfig)
    assert specs["restore_best"].flag == Flag("run policy", negated=True)
    may_change = {n for n, s in specs.items() if s.on_resume == "may_change"}
    assert "keep_checkpoints" in may_change and "epochs" not in may_change


def test_an_option_row_escapes_pipes_and_leaves_a_switch_without_default():
    switch = Option(dest="fresh", action="store_true", group="failures", help="a|b")
    assert switch.row() == "| `--fresh` | | a\\|b |"
    assert switch.full_help == "a|b"
    choice = Option(dest="mode", group="failures", default="x", choices=("x", "y"), help="m")
    assert choice.row() == "| `--mode x\\|y` | x | m |"
    assert choice.full_help == "m (default: x)"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--monitor-mode", "maximum"], "invalid choice: 'maximum'"),
        (["--monitor", "9x"], "metric name '9x' is not allowed"),
        (["--monitor", "batches"], "'batches' is reported on its own"),
    ],
)
def test_monitor_options_are_checked_when_parsed(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["run", "--nproc", "2", *argv, "s.py"])
    assert info.value.code == 2
    assert said in capsys.readouterr().err
