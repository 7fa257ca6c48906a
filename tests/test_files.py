"""The safe-file primitives every writer and reader of a run directory uses
(epochal/rundir/files.py).

The hostile cases are real: a directory another user (``nobody``) created, links planted at the
names a writer uses, a FIFO where a reader expects a file. The tests that need a second user run
as root (as CI does) and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from epochal.rundir import files
from epochal.text import printable
from tests.security.other_user import as_other_user, needs_root, shared_scratch


def test_private_dir_is_created_0700_with_its_missing_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "run"
    old = os.umask(0)
    try:
        files.private_dir(target, kind="run directory")
    finally:
        os.umask(old)
    for made in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700


def test_an_existing_own_directory_not_writable_by_others_is_used(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    assert files.private_dir(target) == target


@pytest.mark.parametrize(("mode", "who"), [(0o775, "its group"), (0o777, "others")])
def test_a_directory_others_may_write_is_refused_naming_the_fix(
    tmp_path: Path, mode: int, who: str
) -> None:
    target = tmp_path / "run"
    target.mkdir()
    os.chmod(target, mode)
    with pytest.raises(files.UnsafePath) as caught:
        files.private_dir(target, kind="run directory")
    assert f"writable by {who}" in str(caught.value)
    assert f"chmod go-w {target}" in str(caught.value)


def test_a_link_to_a_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "run"
    link.symlink_to(real)
    with pytest.raises(files.UnsafePath, match="symbolic link"):
        files.private_dir(link, kind="run directory")


@needs_root
def test_a_directory_another_user_created_is_refused() -> None:
    with shared_scratch() as shared:
        as_other_user(["mkdir", "-m", "755", str(shared / "run")])
        with pytest.raises(files.UnsafePath) as caught:
            files.private_dir(shared / "run", kind="run directory")
    assert "belongs to another user (uid 65534" in str(caught.value)


def test_write_atomic_replaces_a_planted_link_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "result.json"
    target.symlink_to(victim)
    files.write_atomic(target, "{}\n")
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_text() == "{}\n"
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_create_exclusive_never_opens_an_existing_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "planted").symlink_to(victim)
    with pytest.raises(FileExistsError):
        files.create_exclusive(tmp_path / "planted")
    assert victim.read_text() == "precious"


def test_open_append_refuses_a_link_and_appends_to_its_own_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    log = tmp_path / "epochs.jsonl"
    log.symlink_to(victim)
    with pytest.raises(files.UnsafePath, match="symbolic link"):
        files.open_append(log)
    log.unlink()
    with files.open_append(log) as f:
        f.write("one\n")
    with files.open_append(log) as f:
        f.write("two\n")
    assert log.read_text() == "one\ntwo\n"
    assert victim.read_text() == "precious"
    assert stat.S_IMODE(os.lstat(log).st_mode) == 0o600


def test_read_regular_refuses_links_fifos_devices_and_large_files(tmp_path: Path) -> None:
    good = tmp_path / "status.json"
    good.write_bytes(b"x" * 10)
    assert files.read_regular(good, 10) == b"x" * 10
    with pytest.raises(files.NotRegular, match="over the 9"):
        files.read_regular(good, 9)
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    with pytest.raises(files.NotRegular, match="symbolic link"):
        files.read_regular(link, 1 << 20)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def read_fifo() -> None:
        with pytest.raises(files.NotRegular, match="not a regular file"):
            files.read_regular(fifo, 1 << 20)
        done.set()

    reader = threading.Thread(target=read_fifo, daemon=True)
    reader.start()
    reader.join(timeout=10)  # a blocking open would never return: no writer ever comes
    assert done.is_set(), "reading a FIFO blocked"
    with pytest.raises(FileNotFoundError):
        files.read_regular(tmp_path / "missing", 10)


def test_printable_escapes_control_characters_and_bounds_the_length() -> None:
    assert printable("node-1") == "node-1"
    assert printable("a\nb\x1b[2J") == "a\\nb\\x1b[2J"
    long = printable("x" * 70_000)
    assert len(long) == 203 and long.endswith("...")
    assert printable(42) == "42"
