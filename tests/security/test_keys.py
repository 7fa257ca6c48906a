"""Key files: what ``generate`` writes, what the loaders accept, and what every refusal says.

Every load error is a ConfigError naming the file and the fix: a coordinator whose keys fail to
load stops at start, never runs with an allow-list that silently refuses everyone.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import stat
from pathlib import Path

import pytest
import zmq

from epochal.errors import ConfigError
from epochal.security import (
    CURVE_KEY_ENV,
    CURVE_SERVER_KEY_ENV,
    ClientSecurity,
    KeyDirectory,
    ServerSecurity,
    generate,
    load_allowed,
    load_client_keys,
    load_coordinator_public,
    load_public,
    load_server_keys,
)
from epochal.security.keycommand import (
    add_coordinator_arguments,
    add_keys_command,
    run_keys_command,
    server_security_from_args,
)

pytestmark = pytest.mark.timeout(30)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---------------------------------------------------------------------- generate


def test_generate_lays_out_keys_by_destination(keydir: KeyDirectory) -> None:
    root = keydir.root
    assert keydir.coordinator_secret == root / "coordinator.key_secret"
    assert keydir.coordinator_public == root / "coordinator.key"
    assert keydir.allowed == root / "allowed"
    assert sorted(p.name for p in keydir.allowed.iterdir()) == ["worker-0.key", "worker-1.key"]
    assert sorted(p.name for p in (root / "workers").iterdir()) == [
        "worker-0.key_secret",
        "worker-1.key_secret",
    ]
    assert set(keydir.worker_secrets) == {"worker-0", "worker-1"}


def test_generated_keys_belong_together(keydir: KeyDirectory) -> None:
    public, secret = load_server_keys(keydir.coordinator_secret)
    assert zmq.curve_public(secret) == public
    assert load_coordinator_public(keydir.coordinator_public) == public
    allowed = load_allowed(keydir.allowed)
    workers = {load_client_keys(path)[0] for path in keydir.worker_secrets.values()}
    assert allowed == workers
    assert len(workers) == 2
    assert public not in allowed


def test_secret_files_are_0600_in_0700_directories(keydir: KeyDirectory) -> None:
    assert mode(keydir.coordinator_secret) == 0o600
    for path in keydir.worker_secrets.values():
        assert mode(path) == 0o600
    for directory in (keydir.root, keydir.allowed, keydir.root / "workers"):
        assert mode(directory) == 0o700


def test_secret_mode_does_not_depend_on_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        keys = generate(tmp_path / "keys", workers=1)
    finally:
        os.umask(old)
    assert mode(keys.coordinator_secret) == 0o600
    assert mode(keys.worker_secrets["worker-0"]) == 0o600
    assert mode(keys.root) == 0o700


def test_generate_with_names(tmp_path: Path) -> None:
    keys = generate(tmp_path / "keys", names=["gpu-a", "gpu-b", "cpu.1"])
    assert set(keys.worker_secrets) == {"gpu-a", "gpu-b", "cpu.1"}
    assert keys.worker_secrets["gpu-a"].name == "gpu-a.key_secret"
    assert (keys.allowed / "cpu.1.key").is_file()


def test_generate_into_an_existing_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir(mode=0o755)
    keys = generate(tmp_path / "keys")
    assert mode(keys.root) == 0o700


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 0}, "workers must be an integer >= 1"),
        ({"names": []}, "name at least one worker"),
        ({"names": ["a", "a"]}, "repeated: a"),
        ({"names": ["../escape"]}, "is not allowed"),
        ({"names": ["coordinator"]}, "cannot be named 'coordinator'"),
    ],
)
def test_generate_refuses_bad_names(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        generate(tmp_path / "keys", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "keys").exists()


def test_generate_never_overwrites(keydir: KeyDirectory) -> None:
    before = keydir.coordinator_secret.read_bytes()
    with pytest.raises(ConfigError, match="is not empty: keys are never overwritten"):
        generate(keydir.root, workers=1)
    assert keydir.coordinator_secret.read_bytes() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_generate_refuses_a_directory_owned_by_another_user(tmp_path: Path) -> None:
    # root may chmod it to 0700, but its owner keeps full access and could read the secrets
    (tmp_path / "keys").mkdir(mode=0o700)
    os.chown(tmp_path / "keys", 54321, 54321)
    with pytest.raises(ConfigError, match=r"belongs to another user \(uid 54321\)"):
        generate(tmp_path / "keys")
    assert not any((tmp_path / "keys").iterdir())


def test_generate_refuses_a_file_as_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        generate(tmp_path / "file")


# ---------------------------------------------------------------------- loading errors


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("loader", "name", "content", "message"),
    [
        (load_server_keys, "missing.key_secret", None, "does not exist: pass the coordinator"),
        (load_client_keys, "missing.key_secret", None, "does not exist: pass this worker"),
        (load_coordinator_public, "missing.key", None, "does not exist: pass the coordinator.key"),
        (load_server_keys, "junk.key_secret", "hello\n", "is not a CURVE key file"),
        (load_public, "junk.key", "\x00\x01binary", "is not a CURVE key file"),
        (load_public, "short.key", 'curve\n    public-key = "abc"\n', "is not a CURVE key"),
        (
            load_public,
            "badchars.key",
            'curve\n    public-key = "' + "~" * 40 + '"\n',
            "is not a CURVE key",
        ),
    ],
)
def test_load_errors_name_the_file_and_the_fix(
    tmp_path: Path, loader: object, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        loader(path)  # type: ignore[operator]
    assert str(path) in str(err.value)


def test_a_public_key_file_is_not_a_secret_key_file(keydir: KeyDirectory) -> None:
    with pytest.raises(
        ConfigError, match=re.escape("holds only a public key: pass the .key_secret file")
    ):
        load_server_keys(keydir.coordinator_public)
    with pytest.raises(ConfigError, match="holds only a public key"):
        load_client_keys(keydir.allowed / "worker-0.key")


def test_a_secret_key_file_is_refused_where_a_public_key_belongs(keydir: KeyDirectory) -> None:
    with pytest.raises(ConfigError, match="holds a secret key"):
        load_coordinator_public(keydir.coordinator_secret)


def test_a_secret_that_does_not_match_its_public_key(keydir: KeyDirectory, tmp_path: Path) -> None:
    other_public, _ = zmq.curve_keypair()
    text = keydir.coordinator_secret.read_text()
    real_public = load_server_keys(keydir.coordinator_secret)[0]
    tampered = write(
        tmp_path / "tampered.key_secret", text.replace(real_public.decode(), other_public.decode())
    )
    with pytest.raises(ConfigError, match="do not belong together"):
        load_server_keys(tampered)


def test_a_directory_is_not_a_key_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory, not a key file"):
        load_server_keys(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_key_file(keydir: KeyDirectory) -> None:
    keydir.coordinator_secret.chmod(0)
    with pytest.raises(ConfigError, match="cannot read coordinator secret key file"):
        load_server_keys(keydir.coordinator_secret)


def test_a_read_error_is_reported_with_its_reason(
    keydir: KeyDirectory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same as above for a root test run: the read itself fails."""

    def denied(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(zmq.auth, "load_certificate", denied)
    with pytest.raises(
        ConfigError, match=r"cannot read worker secret key file .*Permission denied"
    ):
        load_client_keys(keydir.worker_secrets["worker-0"])


def test_allow_list_errors_are_never_a_silent_deny_all(
    keydir: KeyDirectory, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_allowed(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="is not a directory"):
        load_allowed(keydir.coordinator_public)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"holds no worker public keys.*refuse every worker"):
        load_allowed(empty)
    # secret files are not public keys: a directory of only those is empty too
    with pytest.raises(ConfigError, match="holds no worker public keys"):
        load_allowed(keydir.root / "workers")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "good.key").write_bytes((keydir.allowed / "worker-0.key").read_bytes())
    write(broken / "bad.key", "not a key\n")
    with pytest.raises(ConfigError, match=re.escape("bad.key is not a CURVE key file")):
        load_allowed(broken)


def test_allow_list_refuses_a_secret_key(keydir: KeyDirectory, tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "leaked.key").write_bytes(keydir.worker_secrets["worker-0"].read_bytes())
    with pytest.raises(ConfigError, match=re.escape("leaked.key holds a secret key")):
        load_allowed(allowed)


# ---------------------------------------------------------------------- settings objects


def test_server_security_from_paths(keydir: KeyDirectory) -> None:
    security = ServerSecurity.from_paths(keydir.coordinator_secret, keydir.allowed)
    assert security.allowed == load_allowed(keydir.allowed)
    assert security.domain == "epochal"
    assert security.secret.decode() not in repr(security)


def test_server_security_refuses_an_empty_allow_list(keydir: KeyDirectory) -> None:
    public, secret = load_server_keys(keydir.coordinator_secret)
    with pytest.raises(ConfigError, match="allow-list of worker keys is empty"):
        ServerSecurity(public=public, secret=secret, allowed=frozenset())
    with pytest.raises(ConfigError, match="not one key pair"):
        ServerSecurity(public=zmq.curve_keypair()[0], secret=secret, allowed=frozenset([public]))
    with pytest.raises(ConfigError, match="ZAP domain"):
        ServerSecurity(public=public, secret=secret, allowed=frozenset([public]), domain="")


def test_client_security_from_env(keydir: KeyDirectory) -> None:
    secret = keydir.worker_secrets["worker-1"]
    env = {CURVE_KEY_ENV: str(secret), CURVE_SERVER_KEY_ENV: str(keydir.coordinator_public)}
    security = ClientSecurity.from_env(env)
    assert security is not None
    assert security.public == load_client_keys(secret)[0]
    assert security.server_public == load_coordinator_public(keydir.coordinator_public)
    assert security.secret.decode() not in repr(security)


def test_client_security_off_without_keys() -> None:
    assert ClientSecurity.from_env({}) is None
    assert ClientSecurity.from_env({CURVE_KEY_ENV: "", CURVE_SERVER_KEY_ENV: ""}) is None


def test_client_security_explicit_argument_wins(keydir: KeyDirectory, tmp_path: Path) -> None:
    env = {CURVE_KEY_ENV: str(tmp_path / "nope"), CURVE_SERVER_KEY_ENV: str(tmp_path / "nope")}
    security = ClientSecurity.from_env(
        env,
        key_file=keydir.worker_secrets["worker-0"],
        server_key_file=keydir.coordinator_public,
    )
    assert security is not None
    # an argument for one field still lets the environment supply the other
    with pytest.raises(ConfigError, match="nope does not exist"):
        ClientSecurity.from_env(env, key_file=keydir.worker_secrets["worker-0"])


@pytest.mark.parametrize(
    ("present", "missing"),
    [(CURVE_KEY_ENV, CURVE_SERVER_KEY_ENV), (CURVE_SERVER_KEY_ENV, CURVE_KEY_ENV)],
)
def test_half_configured_worker_is_an_error(
    keydir: KeyDirectory, present: str, missing: str
) -> None:
    with pytest.raises(ConfigError, match=f"set {missing}="):
        ClientSecurity.from_env({present: str(keydir.coordinator_public)})


# ---------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epochal")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_keys_command(sub)
    coordinator = sub.add_parser("coordinator")
    add_coordinator_arguments(coordinator)
    return p


def test_keys_generate_command(tmp_path: Path) -> None:
    target = tmp_path / "keys"
    args = parser().parse_args(["keys", "generate", str(target), "--workers", "3"])
    out = io.StringIO()
    assert run_keys_command(args, out=out) == 0
    text = out.getvalue()
    assert len(list((target / "allowed").iterdir())) == 3
    assert str(target / "coordinator.key_secret") in text
    assert str(target / "workers" / "worker-2.key_secret") in text
    assert f"--curve-key {target / 'coordinator.key_secret'}" in text
    assert f"--curve-allowed {target / 'allowed'}" in text
    assert f"{CURVE_KEY_ENV}={target / 'workers' / 'worker-0.key_secret'}" in text
    assert f"{CURVE_SERVER_KEY_ENV}={target / 'coordinator.key'}" in text


def test_keys_generate_named_workers(tmp_path: Path) -> None:
    args = parser().parse_args(
        ["keys", "generate", str(tmp_path / "k"), "--name", "alpha", "--name", "beta"]
    )
    assert run_keys_command(args, out=io.StringIO()) == 0
    assert sorted(p.name for p in (tmp_path / "k" / "allowed").iterdir()) == [
        "alpha.key",
        "beta.key",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["keys"],
        ["keys", "generate"],
        ["keys", "generate", "d", "--workers", "0"],
        ["keys", "generate", "d", "--workers", "2", "--name", "a"],
    ],
)
def test_keys_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_keys_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["keys", "generate", "--help"])
    assert exit_.value.code == 0
    assert "--workers N" in capsys.readouterr().out


def test_coordinator_flags(keydir: KeyDirectory) -> None:
    p = parser()
    assert server_security_from_args(p.parse_args(["coordinator"])) is None
    args = p.parse_args(
        [
            "coordinator",
            "--curve-key",
            str(keydir.coordinator_secret),
            "--curve-allowed",
            str(keydir.allowed),
        ]
    )
    security = server_security_from_args(args)
    assert security is not None
    assert security.allowed == load_allowed(keydir.allowed)
    with pytest.raises(ConfigError, match="--curve-allowed DIR too"):
        server_security_from_args(p.parse_args(["coordinator", "--curve-key", "x"]))
    with pytest.raises(ConfigError, match="--curve-key FILE too"):
        server_security_from_args(p.parse_args(["coordinator", "--curve-allowed", "x"]))
