"""A run's directories and files on a machine other users share.

The attacker is another local user (``nobody``, through ``setpriv``; these tests need root, as in
CI). Where a victim will run (a path in a shared scratch directory), the attacker makes the run
directory first and plants symbolic links in it at the names the run writes through, pointing at
the victim's own files: the run must be refused before any worker starts, naming the directory
and the fix, and no victim file may change. Links left in the victim's own run directory (by an
earlier process of the victim's) must never be followed either: the run finishes, the files
they point at untouched. Then each writer and reader one by one: the journal, status.json, the
address file, the checkpoint directory under ``--fresh``, the default ``runs/``, the
TensorBoard directory and the journal read back on resume.
"""

from __future__ import annotations

import os
import shlex
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from epochal.cli import parser as cli
from epochal.coordinator.config import CoordinatorConfig
from epochal.coordinator.serve import background
from epochal.coordinator.serve.journal import Journal
from epochal.coordinator.serve.resume import config_record, inspect, start_fresh
from epochal.errors import ConfigError
from epochal.observe import watching as observe_options
from epochal.observe.observer import RunStart
from epochal.observe.statusfile import StatusFile
from epochal.rundir import addressfile
from epochal.rundir.files import UnsafePath
from tests.integration.conftest import SCRIPTS, Spawner
from tests.security.other_user import as_other_user, needs_root, shared_scratch

RENDEZVOUS_TIMEOUT = 120.0
DEADLINE = 2 * RENDEZVOUS_TIMEOUT + 60
"""A two-epoch run of linear.py (about 12 s alone); only a hang reaches this."""

PROMPT = 10.0
"""How long a read is given before it counts as blocked (it never waits for anything)."""

RUN_NAMES = ("run.json.tmp", "epochs.jsonl.tmp", "result.json.tmp", ".curve.png.tmp")
"""Names the coordinator and the observers wrote through (a fixed temporary name each)."""

MODEL_NAME = "model.json.tmp"
"""The fixed temporary name model.json was written through."""


class Victims:
    """Files of the victim's that planted links point at; :meth:`changed` names any that
    changed (content, mode or modification time)."""

    def __init__(self, root: Path, names: Iterable[str]) -> None:
        root.mkdir(mode=0o700)
        self.files: dict[str, Path] = {}
        for name in names:
            path = root / f"victim-{name.strip('.')}"
            path.write_bytes(f"precious: {name}\n".encode())
            os.chmod(path, 0o644)
            self.files[name] = path
        self._before = {name: self._look(path) for name, path in self.files.items()}

    @staticmethod
    def _look(path: Path) -> tuple[bytes, int, int]:
        st = os.lstat(path)
        return path.read_bytes(), stat.S_IMODE(st.st_mode), st.st_mtime_ns

    def links(self, directory: Path) -> list[tuple[Path, Path]]:
        """(link, target) for a link at each name in ``directory``."""
        return [(directory / name, target) for name, target in self.files.items()]

    def plant(self, directory: Path) -> None:
        for link, target in self.links(directory):
            link.symlink_to(target)

    def changed(self) -> list[str]:
        return [
            f"{path} ({name})"
            for name, path in self.files.items()
            if self._look(path) != self._before[name]
        ]


def made_by_the_other_user(directory: Path, victims: Victims, mode: str = "755") -> None:
    """``directory`` made by ``nobody``, with its links to the victim's files in it."""
    script = [f"mkdir -m {mode} {shlex.quote(str(directory))}"] + [
        f"ln -s {shlex.quote(str(target))} {shlex.quote(str(link))}"
        for link, target in victims.links(directory)
    ]
    as_other_user(["sh", "-c", " && ".join(script)])


def run_start(run_dir: Path) -> RunStart:
    return RunStart(
        run_id="r",
        run_dir=run_dir,
        endpoint="tcp://127.0.0.1:5555",
        world_size=2,
        epochs=10,
        attempt=0,
        resumed_from=None,
    )


def linear_run(spawn: Spawner, run_dir: Path) -> Any:
    return spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--rendezvous-timeout",
        f"{RENDEZVOUS_TIMEOUT:g}",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "linear.py"),
    )


# ------------------------------------------------------------------ the attack, for real


@needs_root
def test_a_run_directory_another_user_made_is_refused_before_any_worker_starts(
    spawn: Spawner, tmp_path: Path
) -> None:
    victims = Victims(tmp_path / "victim", (*RUN_NAMES, MODEL_NAME))
    with shared_scratch() as shared:
        run_dir = shared / "run"
        made_by_the_other_user(run_dir, victims)
        code, output = spawn.finish(linear_run(spawn, run_dir), DEADLINE)
        left = sorted(p.name for p in run_dir.iterdir())
    spawn.assert_none_left()
    lines = output.strip().splitlines()
    assert code == 2 and len(lines) == 1, output
    assert lines[0].startswith(
        f"epochal: error: refusing the run directory: {run_dir} belongs to another user (uid 65534"
    ), output
    assert "Use a run directory of your own" in lines[0], output
    assert victims.changed() == []
    assert left == sorted(victims.files), "the refused run wrote into the directory"


@pytest.mark.slow
def test_links_left_in_the_users_own_run_directory_are_never_followed(
    spawn: Spawner, tmp_path: Path
) -> None:
    victims = Victims(tmp_path / "victim", RUN_NAMES)
    with shared_scratch() as shared:
        run_dir = shared / "run"
        run_dir.mkdir(mode=0o700)
        victims.plant(run_dir)  # by an earlier process of the same user's
        code, output = spawn.finish(linear_run(spawn, run_dir), DEADLINE)
        spawn.assert_none_left()
        assert code == 0, output
        assert victims.changed() == []
        for name in ("run.json", "epochs.jsonl", "result.json", "status.json", "curve.png"):
            st = os.lstat(run_dir / name)
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name


# ------------------------------------------------------------------ the writers, one by one


def test_the_journal_never_writes_through_a_link(tmp_path: Path) -> None:
    victims = Victims(tmp_path / "victim", RUN_NAMES)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victims.plant(run_dir)
    journal = Journal(run_dir)
    journal.rewrite([{"kind": "checkpoint", "epoch": 0}])
    journal.start({"run_id": "r"})
    journal.epoch({"kind": "checkpoint", "epoch": 1})
    journal.result({"status": "finished"})
    journal.close()
    assert victims.changed() == []
    assert (run_dir / "epochs.jsonl").read_text().count("\n") == 2
    for name in ("run.json", "epochs.jsonl", "result.json"):
        st = os.lstat(run_dir / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name


@needs_root
def test_the_journal_refuses_a_directory_another_user_made() -> None:
    with shared_scratch() as shared:
        as_other_user(["mkdir", "-m", "777", str(shared / "run")])
        with pytest.raises(UnsafePath, match="belongs to another user"):
            Journal(shared / "run")
        assert list((shared / "run").iterdir()) == []


def test_status_json_never_writes_through_a_link(tmp_path: Path) -> None:
    # status.json's temporary name was the coordinator's pid: known to anyone who runs `ps`
    name = f".status.json.{os.getpid()}.tmp"
    victims = Victims(tmp_path / "victim", [name])
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victims.plant(run_dir)
    StatusFile(run_dir).on_start(run_start(run_dir))
    assert victims.changed() == []
    st = os.lstat(run_dir / "status.json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_status_json_is_not_written_in_a_directory_others_may_write(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    with pytest.raises(UnsafePath, match=f"chmod go-w {run_dir}"):
        StatusFile(run_dir).on_start(run_start(run_dir))
    assert list(run_dir.iterdir()) == []


@needs_root
def test_the_address_file_is_never_written_through_a_link(tmp_path: Path) -> None:
    # the address file's directory may be shared by design (a job's directory); here another
    # user owns it and has planted links at the file and at the temporary name it was written
    # through (the coordinator's pid)
    path_name = "coordinator.addr"
    names = [path_name, f".{path_name}.{os.getpid()}.tmp"]
    victims = Victims(tmp_path / "victim", names)
    with shared_scratch() as shared:
        job = shared / "job"
        made_by_the_other_user(job, victims, mode="777")
        addressfile.write(job / path_name, "tcp://10.0.0.5:29400")
        st = os.lstat(job / path_name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert addressfile.wait_for(job / path_name, 0) == "tcp://10.0.0.5:29400"
    assert victims.changed() == []


def blocks(call: Callable[[], Any], fifo: Path) -> BaseException | None:
    """Run ``call``, which reads the FIFO ``fifo``; fail if it blocks, else return what it
    raised. A reader blocked in open() is let go by opening the FIFO for writing, so a test of
    the code that blocks fails instead of hanging."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(PROMPT)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(PROMPT)
        pytest.fail(f"reading the FIFO {fifo} blocked")
    return raised[0] if raised else None


def test_a_worker_waiting_for_the_address_file_is_not_hung_by_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "coordinator.addr"
    os.mkfifo(fifo)
    error = blocks(lambda: addressfile.wait_for(fifo, 0), fifo)
    assert isinstance(error, ConfigError), error
    assert f"{fifo} is not a regular file" in str(error) and "--address-file" in str(error)


# ------------------------------------------------------------------ the directories


@needs_root
@pytest.mark.parametrize("option", ["run_dir", "checkpoint_dir"])
def test_the_python_api_refuses_a_directory_another_user_made(tmp_path: Path, option: str) -> None:
    with shared_scratch() as shared:
        as_other_user(["mkdir", "-m", "777", str(shared / "theirs")])
        options: dict[str, Any] = {"run_dir": tmp_path / "run", option: shared / "theirs"}
        with pytest.raises(UnsafePath) as caught:
            background.start_coordinator(1, epochs=1, rendezvous_timeout=1.0, **options)
        assert list((shared / "theirs").iterdir()) == []
    kind = "run directory" if option == "run_dir" else "checkpoint directory"
    assert str(caught.value).startswith(
        f"refusing the {kind}: {shared / 'theirs'} belongs to another user"
    )


def test_fresh_refuses_a_checkpoint_directory_that_is_a_link(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "checkpoints").symlink_to(precious)
    config = CoordinatorConfig(world_size=1, run_dir=run_dir)
    with pytest.raises(UnsafePath) as caught:
        start_fresh(config, config.checkpoint_path)
    assert "is a symbolic link" in str(caught.value)
    assert str(run_dir / "checkpoints") in str(caught.value)
    assert (precious / "thesis.tex").read_text() == "years of work"


@needs_root
def test_the_default_runs_directory_another_user_made_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with shared_scratch() as shared:
        as_other_user(["mkdir", "-m", "777", str(shared / "runs")])
        monkeypatch.chdir(shared)
        with pytest.raises(SystemExit) as exited:
            cli.main(["coordinator", "--world-size", "1", "--rendezvous-timeout", "1"])
        assert list((shared / "runs").iterdir()) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "epochal: error: refusing the directory of runs: runs belongs to another user"
    )


@needs_root
def test_a_tensorboard_directory_another_user_made_is_refused_before_the_run() -> None:
    pytest.importorskip("tensorboard")
    with shared_scratch() as shared:
        as_other_user(["mkdir", "-m", "777", str(shared / "tb")])
        with pytest.raises(UnsafePath, match="refusing the TensorBoard directory"):
            observe_options.build(None, tensorboard=shared / "tb")
        assert list((shared / "tb").iterdir()) == []


# ------------------------------------------------------------------ the journal read back


def journal_config(tmp_path: Path) -> CoordinatorConfig:
    """A run directory with run.json, ready for an epochs.jsonl to be put in it."""
    run_dir = tmp_path / "run"
    config = CoordinatorConfig(world_size=1, run_dir=run_dir)
    journal = Journal(run_dir)
    journal.start({"config": config_record(config)})
    journal.close()
    (run_dir / "epochs.jsonl").unlink()
    return config


def test_a_resume_does_not_read_a_journal_through_a_link(tmp_path: Path) -> None:
    config = journal_config(tmp_path)
    elsewhere = tmp_path / "someone-elses.jsonl"
    elsewhere.write_text('{"kind": "checkpoint", "epoch": 0}\n')
    assert config.run_dir is not None
    (config.run_dir / "epochs.jsonl").symlink_to(elsewhere)
    with pytest.raises(ConfigError) as caught:
        inspect(config, config.checkpoint_path)
    message = str(caught.value)
    assert f"{config.run_dir / 'epochs.jsonl'} is a symbolic link" in message
    assert "--fresh" in message


def test_a_resume_is_not_hung_by_a_fifo_journal(tmp_path: Path) -> None:
    config = journal_config(tmp_path)
    assert config.run_dir is not None
    fifo = config.run_dir / "epochs.jsonl"
    os.mkfifo(fifo)
    error = blocks(lambda: inspect(config, config.checkpoint_path), fifo)
    assert isinstance(error, ConfigError), error
    assert f"{fifo} is not a regular file" in str(error)


def test_a_resume_refuses_a_journal_larger_than_any_run_writes(tmp_path: Path) -> None:
    config = journal_config(tmp_path)
    assert config.run_dir is not None
    journal = config.run_dir / "epochs.jsonl"
    with open(journal, "wb") as f:
        f.truncate(65 << 20)  # sparse: no disk taken
    with pytest.raises(ConfigError, match=r"over the 67108864 this reader takes"):
        inspect(config, config.checkpoint_path)
