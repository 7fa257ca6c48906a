"""The coordinator's command line for workers on other machines: what it refuses and what it says.

No sockets: the bind address is checked, the commands of the guide's page on workers of other
machines (docs/hosts.md) are parsed and the attach hint is rendered, all in this process.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from epochal.cli.parser import build_parser, check_bind, check_exposure, main
from epochal.coordinator.serve.attach import attach_hint, connectable
from epochal.errors import ConfigError
from epochal.security.keycommand import server_security_from_args

HOSTS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "hosts.md"


@pytest.mark.parametrize("insecure", [False, True])
def test_a_bind_without_scheme_is_refused_naming_the_form(insecure, capsys):
    flags = ["--insecure"] if insecure else []
    with pytest.raises(SystemExit) as exit_:
        main(["coordinator", "--world-size", "1", "--bind", "127.0.0.1:29407", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--bind needs tcp://HOST:PORT (got '127.0.0.1:29407')" in err
    assert "CURVE keys" not in err.splitlines()[0].split("(got")[0]
    assert "Invalid argument" not in err


@pytest.mark.parametrize(
    "bind",
    [
        "127.0.0.1:29407",
        "tcp://127.0.0.1",
        "tcp://:29400",
        "tcp://host:port",
        "udp://h:1",
        "ipc://",
    ],
)
def test_malformed_binds_are_refused(bind):
    with pytest.raises(
        ConfigError, match=re.escape(f"--bind needs tcp://HOST:PORT (got {bind!r})")
    ):
        check_bind(bind)


@pytest.mark.parametrize(
    "bind",
    ["tcp://127.0.0.1:0", "tcp://0.0.0.0:29400", "tcp://*:29400", "tcp://[::1]:5", "ipc:///tmp/x"],
)
def test_wellformed_binds_pass(bind):
    assert check_bind(bind) == bind


def _commands(page: Path) -> list[list[str]]:
    """The shell commands of a guide page's code blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line and not line.startswith("#")]


def test_the_guides_multi_machine_coordinator_command_is_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = _commands(HOSTS_PAGE)
    keys = next(c for c in commands if c[:3] == ["epochal", "keys", "generate"])
    assert main(keys[1:]) == 0
    coordinator = next(c for c in commands if c[:2] == ["epochal", "coordinator"])
    args = build_parser().parse_args(coordinator[1:])
    security = server_security_from_args(args)
    # refused (ConfigError) unless the command holds keys; silent (None) when it does
    assert check_exposure(args.bind, security is not None, args.insecure) is None
    worker = next(c for c in commands if any(w.startswith("EPOCHAL_COORDINATOR=") for w in c))
    env = dict(w.split("=", 1) for w in worker if "=" in w and w.startswith("EPOCHAL_"))
    assert Path(env["EPOCHAL_CURVE_SERVER_KEY"]).is_file()
    assert Path(env["EPOCHAL_CURVE_KEY"]).is_file()


def test_the_attach_hint_names_a_dialable_address_and_the_curve_variables():
    hint = attach_hint(
        "tcp://0.0.0.0:29401",
        address="10.1.2.3",
        server_secret_key=Path("/keys/coordinator.key_secret"),
        allowed_dir=Path("/keys/allowed"),
    )
    first = hint.splitlines()[0]
    assert "EPOCHAL_COORDINATOR=tcp://10.1.2.3:29401" in first
    assert "0.0.0.0" not in first
    assert "EPOCHAL_CURVE_SERVER_KEY=/keys/coordinator.key" in first
    assert "EPOCHAL_CURVE_KEY=/keys/workers/NAME.key_secret" in first
    assert "default route" in hint and "copy coordinator.key" in hint


def test_the_attach_hint_of_a_plain_loopback_coordinator_is_one_line():
    hint = attach_hint("tcp://127.0.0.1:5000", address="10.1.2.3")
    assert hint == "attach workers with: EPOCHAL_COORDINATOR=tcp://127.0.0.1:5000 python SCRIPT"


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://0.0.0.0:1", ("tcp://h:1", True)),
        ("tcp://*:1", ("tcp://h:1", True)),
        ("tcp://[::]:1", ("tcp://h:1", True)),
        ("tcp://10.0.0.5:1", ("tcp://10.0.0.5:1", False)),
        ("ipc:///tmp/s", ("ipc:///tmp/s", False)),
    ],
)
def test_only_a_wildcard_host_is_replaced(endpoint, expected):
    assert connectable(endpoint, "h") == expected
