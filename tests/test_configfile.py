"""Settings from a TOML file: the command line wins over the file, the file over the defaults.

The file is read by ``--config FILE``, and by ``epochal run`` from ``epochal.toml`` beside the
script unless ``--no-config``; its values are checked by the options' own types.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from epochal.cli import configfile
from epochal.cli import parser as cli


def parse(*argv: str):
    return configfile.parse_args(cli.build_parser(), list(argv))


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def script(tmp_path: Path) -> Path:
    return write(tmp_path / "train.py", "")


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    assert exc.value.code == cli.EXIT_USAGE
    return capsys.readouterr().err


def test_run_takes_the_file_over_the_default_and_the_command_line_over_the_file(tmp_path, script):
    config = write(tmp_path / "s.toml", 'epochs = 20\npatience = 3\nlr_schedule = "cosine"\n')
    args, read = parse("run", "--nproc", "2", "--config", str(config), "--epochs", "5", str(script))
    default, _ = parse("run", "--nproc", "2", str(script))
    assert read == config
    assert args.epochs == 5  # the command line
    assert args.patience == 3 and args.lr_schedule == "cosine"  # the file
    assert (default.patience, default.lr_schedule) != (3, "cosine")
    for dest in ("min_delta", "checkpoint_every", "stall_timeout", "max_restarts"):
        assert getattr(args, dest) == getattr(default, dest)  # the defaults


def test_coordinator_takes_a_required_option_from_the_file(tmp_path):
    config = write(tmp_path / "c.toml", "world_size = 4\nepochs = 7\nbind = 'tcp://127.0.0.1:5'\n")
    args, _ = parse("coordinator", "--config", str(config), "--epochs", "9")
    assert (args.world_size, args.epochs, args.bind) == (4, 9, "tcp://127.0.0.1:5")
    args, _ = parse("coordinator", "--config", str(config), "--world-size", "2")
    assert (args.world_size, args.epochs) == (2, 7)
    config_for = cli._config(args, args.world_size, "", "r")
    assert config_for.epochs == 7 and config_for.world_size == 2


def test_an_option_the_file_does_not_give_stays_required(tmp_path, capsys):
    config = write(tmp_path / "c.toml", "epochs = 7\n")
    err = usage_error(capsys, "coordinator", "--config", str(config))
    assert "the following arguments are required: --world-size" in err


def test_keys_may_be_spelled_with_dashes_and_switches_take_booleans(tmp_path, script):
    config = write(
        tmp_path / "s.toml",
        "stall-timeout = 90\nrestore_best = false\nfresh = true\nrun_dir = 'out/r1'\n"
        "keep_schedule = true\n",
    )
    args, _ = parse("run", "--nproc", "1", "--config", str(config), str(script))
    assert args.stall_timeout == 90.0
    assert args.restore_best is False and args.fresh is True and args.keep_schedule is True
    assert args.run_dir == Path("out/r1")


def test_worker_reads_its_own_options_from_the_file(tmp_path):
    config = write(tmp_path / "w.toml", 'connect = "tcp://10.0.0.5:29400"\nmax_restarts = 3\n')
    args, _ = parse("worker", "--config", str(config), "--", "python", "train.py")
    assert args.connect == "tcp://10.0.0.5:29400" and args.max_restarts == 3
    assert args.worker_command == ["--", "python", "train.py"]


def test_run_reads_epochal_toml_beside_the_script(tmp_path, script, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # the file is found beside the script, not in the cwd
    beside = write(tmp_path / "epochal.toml", "epochs = 2\n")
    args, read = parse("run", "--nproc", "1", str(script), "--epochs", "9")
    assert read == beside and args.epochs == 2  # --epochs after SCRIPT is the script's
    assert args.script_args == ["--epochs", "9"]
    skipped, read = parse("run", "--nproc", "1", "--no-config", str(script))
    assert read is None and skipped.epochs != 2
    other = write(tmp_path / "other.toml", "epochs = 4\n")
    args, read = parse("run", "--nproc", "1", "--config", str(other), str(script))
    assert read == other and args.epochs == 4  # --config replaces the default file


def test_coordinator_reads_no_file_unless_told(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "epochal.toml", "epochs = 2\n")
    args, read = parse("coordinator", "--world-size", "1")
    assert read is None and args.epochs != 2


def test_an_unknown_key_is_named_with_the_closest_valid_ones(tmp_path, script, capsys):
    write(tmp_path / "epochal.toml", "epoch = 3\n")
    err = usage_error(capsys, "run", "--nproc", "1", str(script))
    assert f"epochal: error: {tmp_path / 'epochal.toml'}: unknown key 'epoch'" in err
    assert "did you mean 'epochs'" in err
    config = write(tmp_path / "c.toml", "nproc = 2\n")  # a run's option, not the coordinator's
    err = usage_error(capsys, "coordinator", "--world-size", "1", "--config", str(config))
    assert f"{config}: unknown key 'nproc'" in err


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("epochs = 0", "epochs: must be >= 1, got 0"),  # the CLI's own message
        ("patience = -1", "patience: must be >= 0, got -1"),
        ("stall_timeout = -5", "stall_timeout: must be a positive number of seconds, got -5"),
        ('epochs = "ten"', "epochs: expected an integer, got a string ('ten')"),
        ('epochs = "20"', "epochs: expected an integer, got a string ('20')"),
        ("epochs = 2.5", "epochs: expected an integer, got a number (2.5)"),
        ("smoothing = 'high'", "smoothing: expected a number, got a string ('high')"),
        ("restore_best = 0", "restore_best: expected true or false, got an integer (0)"),
        ("lr_schedule = 3", "lr_schedule: expected a string, got an integer (3)"),
        ('batch_policy = "drop"', "batch_policy: invalid choice: 'drop'"),
        ("epochs = [1, 2]", "epochs: expected an integer, got an array"),
        ("epochs = ", "not valid TOML"),
    ],
)
def test_a_bad_value_is_refused_naming_the_file_and_the_key(tmp_path, script, capsys, text, says):
    config = write(tmp_path / "epochal.toml", text + "\n")
    err = usage_error(capsys, "run", "--nproc", "1", str(script))
    assert f"epochal: error: {config}: {says}" in err, err


def test_the_cli_and_the_file_refuse_a_value_with_the_same_reason(tmp_path, capsys):
    cli_err = usage_error(capsys, "coordinator", "--world-size", "1", "--heartbeat-interval", "0")
    reason = cli_err.rsplit("argument --heartbeat-interval: ", 1)[1].strip()
    config = write(tmp_path / "c.toml", "heartbeat_interval = 0\n")
    err = usage_error(capsys, "coordinator", "--world-size", "1", "--config", str(config))
    assert err.strip() == f"epochal: error: {config}: heartbeat_interval: {reason}"


def test_a_missing_config_file_is_a_usage_error(tmp_path, capsys):
    err = usage_error(capsys, "coordinator", "--world-size", "1", "--config", "nowhere.toml")
    assert "epochal: error: --config: nowhere.toml is not a file" in err


def test_usage_errors_read_as_without_a_settings_file(capsys):
    err = usage_error(capsys, "coordinator", "--epochs", "0")
    assert "--world-size N" in err and "[--world-size N]" not in err  # still shown as required
    assert "argument --epochs: must be >= 1, got 0" in err


def test_a_settings_file_sets_the_steps_per_epoch(tmp_path):
    script = write(tmp_path / "train.py", "")
    config = write(tmp_path / "s.toml", "steps_per_epoch = 40\n")
    args, _ = parse("run", "--nproc", "2", "--config", str(config), str(script))
    assert args.steps_per_epoch == 40
