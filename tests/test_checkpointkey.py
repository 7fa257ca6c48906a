"""The per-user checkpoint key (epochal/rundir/checkpointkey.py): made once and private, read with
care.

Each test points ``XDG_CONFIG_HOME`` or ``EPOCHAL_CHECKPOINT_KEY_FILE`` at its own temporary
directory (through the ``environ`` argument, the process's own variables untouched). The key of
another user is a real file of ``nobody``'s; the tests that need it run as root, as CI does.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from epochal.errors import ConfigError
from epochal.rundir.checkpointkey import (
    KEY_BYTES,
    CheckpointKey,
    default_key_path,
    key_file_problem,
    load_key,
    read_key_file,
)
from epochal.rundir.files import UnsafePath
from tests.security.other_user import OTHER_UID, needs_root

VARIABLE = "EPOCHAL_CHECKPOINT_KEY_FILE"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def key_file(path: Path, *, file_mode: int = 0o600, text: str = "ab" * KEY_BYTES + "\n") -> Path:
    path.write_text(text)
    path.chmod(file_mode)
    return path


def test_the_key_is_made_on_first_use_0600_in_a_0700_directory(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config")}
    old = os.umask(0)  # the modes must not depend on the umask
    try:
        key = load_key(env)
    finally:
        os.umask(old)
    path = tmp_path / "config" / "epochal" / "checkpoint.key"
    assert key.path == path == default_key_path(env)
    assert (mode(path), mode(path.parent)) == (0o600, 0o700)
    assert len(key.secret) == KEY_BYTES
    assert bytes.fromhex(path.read_text().strip()) == key.secret
    assert load_key(env) == key  # the same key every later time
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.key"]  # no temporary left
    assert key.key_id not in path.read_text() and len(key.key_id) == 16


def test_without_xdg_config_home_the_key_is_under_dot_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_key_path({}) == tmp_path / ".config" / "epochal" / "checkpoint.key"
    assert default_key_path({"XDG_CONFIG_HOME": "relative"}) == default_key_path({})


def test_processes_starting_together_end_with_one_key(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    keys: list[CheckpointKey] = []
    start = threading.Barrier(8)

    def first_use() -> None:
        start.wait()
        keys.append(load_key(env))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(keys) == 8
    assert len({k.secret for k in keys}) == 1


def test_the_variable_names_the_key_file_and_nothing_is_made(tmp_path: Path) -> None:
    given = key_file(tmp_path / "shared.key")
    env = {VARIABLE: str(given), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    key = load_key(env)
    assert (key.path, key.secret) == (given, bytes.fromhex("ab" * KEY_BYTES))
    assert not (tmp_path / "config").exists()


def test_a_key_file_the_variable_names_must_exist(tmp_path: Path) -> None:
    env = {VARIABLE: str(tmp_path / "missing.key"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    with pytest.raises(ConfigError, match=f"{VARIABLE}=.*missing.key does not exist") as info:
        load_key(env)
    assert "token_hex(32)" in str(info.value)  # how to make one
    assert not (tmp_path / "missing.key").exists() and not (tmp_path / "config").exists()


def test_a_link_to_a_key_file_is_followed_as_a_mounted_secret_is(tmp_path: Path) -> None:
    # a Kubernetes Secret volume: NAME -> ..data/NAME, the file mode 0400
    (tmp_path / "..data").mkdir()
    key_file(tmp_path / "..data" / "checkpoint.key", file_mode=0o400)
    (tmp_path / "checkpoint.key").symlink_to("..data/checkpoint.key")
    assert len(load_key({VARIABLE: str(tmp_path / "checkpoint.key")}).secret) == KEY_BYTES


@pytest.mark.parametrize("file_mode", [0o644, 0o640, 0o604, 0o620, 0o666])
def test_a_key_file_others_may_read_or_write_is_refused(tmp_path: Path, file_mode: int) -> None:
    path = key_file(tmp_path / "key", file_mode=file_mode)
    with pytest.raises(UnsafePath) as info:
        load_key({VARIABLE: str(path)})
    message = str(info.value)
    assert f"refusing the checkpoint key file {path}" in message
    assert f"mode {file_mode:04o}" in message and "chmod 600" in message
    assert "\n" not in message


def test_the_made_key_is_refused_once_others_may_read_it(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    path = load_key(env).path
    path.chmod(0o644)
    with pytest.raises(UnsafePath, match="chmod 600"):
        load_key(env)


@needs_root
def test_a_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = key_file(tmp_path / "key")
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath) as info:
        load_key({VARIABLE: str(path)})
    assert f"belongs to another user (uid {OTHER_UID}" in str(info.value)


@needs_root
def test_a_configuration_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "epochal"
    planted.mkdir(mode=0o755)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath) as info:
        load_key({"XDG_CONFIG_HOME": str(tmp_path)})
    message = str(info.value)
    assert f"{planted} belongs to another user" in message and VARIABLE in message
    assert list(planted.iterdir()) == []  # no key written where that user could read it


def status(uid: int, file_mode: int, kind: int = stat.S_IFREG) -> os.stat_result:
    return os.stat_result((kind | file_mode, 0, 0, 1, uid, 0, 65, 0, 0, 0))


@pytest.mark.parametrize(
    ("owner", "file_mode", "euid", "fine"),
    [
        (1000, 0o600, 1000, True),
        (1000, 0o400, 1000, True),
        (1000, 0o640, 1000, False),  # its group reads the user's own key
        (1000, 0o604, 1000, False),
        (0, 0o440, 10001, True),  # a Kubernetes Secret for fsGroup: root's, group-readable
        (0, 0o640, 10001, True),
        (0, 0o660, 10001, False),  # its group may write it
        (0, 0o644, 10001, False),  # anyone may read it
        (0, 0o640, 0, False),  # root's own key: 0600 as anyone's
        (0, 0o600, 0, True),
        (2000, 0o600, 1000, False),  # another user's
    ],
)
def test_who_may_own_a_key_file_and_with_what_mode(
    owner: int, file_mode: int, euid: int, fine: bool
) -> None:
    assert (key_file_problem(status(owner, file_mode), euid) is None) is fine


def test_a_key_file_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    assert "not a regular file" in (key_file_problem(status(0, 0o600, stat.S_IFDIR), 0) or "")
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(UnsafePath, match="not a regular file"):  # and nothing blocks on it
        read_key_file(tmp_path / "fifo")


@pytest.mark.parametrize("text", ["", "not hex at all\n", "ab" * 16 + "\n", "ab" * 33])
def test_a_key_file_that_holds_no_key_is_refused(tmp_path: Path, text: str) -> None:
    path = key_file(tmp_path / "key", text=text)
    with pytest.raises(ConfigError, match=f"{path} does not hold 64 hex digits"):
        load_key({VARIABLE: str(path)})
