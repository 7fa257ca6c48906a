"""``epochal keys``: make CURVE keys, and the coordinator's flags that take them.

``epochal keys generate DIR [--workers N | --name NAME ...]`` writes a key directory (layout in
:mod:`epochal.security.keys`) and prints which file goes to which machine. The coordinator's
``--curve-key`` / ``--curve-allowed`` flags are defined here too, so that the deploy text printed
by ``generate`` and the flags a coordinator accepts cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from epochal.cli.argtypes import positive_int
from epochal.environment import CURVE_KEY_ENV, CURVE_SERVER_KEY_ENV
from epochal.errors import ConfigError
from epochal.security.curvekeys import ServerSecurity
from epochal.security.keys import KeyDirectory, generate

SERVER_KEY_FLAG = "--curve-key"
"""Coordinator flag: its secret key file."""

ALLOWED_FLAG = "--curve-allowed"
"""Coordinator flag: the directory of worker public keys it admits."""


def add_keys_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``keys`` (with its ``generate`` subcommand) to the ``epochal`` subparsers.

    ``subparsers`` is what ``ArgumentParser.add_subparsers`` returned. Parsed arguments carry
    ``command == "keys"``; hand them to :func:`run_keys_command`.
    """
    keys = subparsers.add_parser(
        "keys",
        help="make CURVE keys that encrypt the control plane and admit only known workers",
        description="Manage the CURVE keys of a coordinator and its workers. With keys, the "
        "coordinator admits only workers whose public key it holds, and every control "
        "message is encrypted; the data plane (torch.distributed) is not.",
    )
    actions = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    gen = actions.add_parser(
        "generate",
        help="write a coordinator key pair and one key pair per worker into a new directory",
        description="Write a coordinator key pair and one key pair per worker into DIR, which "
        "must not exist or be empty (keys are never overwritten). Secret files are "
        "mode 0600 in a 0700 directory. Prints which file goes to which machine.",
    )
    gen.add_argument("directory", metavar="DIR", help="new directory for the keys")
    who = gen.add_mutually_exclusive_group()
    who.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="number of worker key pairs, named worker-0 ... worker-{N-1} (default: 1)",
    )
    who.add_argument(
        "--name",
        dest="names",
        action="append",
        metavar="NAME",
        help="a worker key pair named NAME (repeat for each worker; instead of --workers)",
    )
    return keys  # type: ignore[no-any-return]


def deploy_text(keys: KeyDirectory) -> str:
    """What was written, and which file goes to which machine."""
    lines = [f"wrote CURVE keys to {keys.root}/", ""]
    rows = [
        (str(keys.coordinator_secret), "coordinator secret key: the coordinator's machine only"),
        (str(keys.coordinator_public), "coordinator public key: copy to every worker machine"),
        (
            f"{keys.allowed}/",
            f"{len(keys.worker_secrets)} worker public key(s): the coordinator's allow-list",
        ),
    ]
    rows += [
        (str(path), f"secret key of {name}: copy to that worker's machine only")
        for name, path in keys.worker_secrets.items()
    ]
    width = max(len(path) for path, _ in rows)
    lines += [f"  {path:<{width}}  {what}" for path, what in rows]
    name, secret = next(iter(keys.worker_secrets.items()))
    lines += [
        "",
        "coordinator:",
        f"  epochal coordinator {SERVER_KEY_FLAG} {keys.coordinator_secret} "
        f"{ALLOWED_FLAG} {keys.allowed} ...",
        f"each worker, e.g. {name}:",
        f"  {CURVE_KEY_ENV}={secret} {CURVE_SERVER_KEY_ENV}={keys.coordinator_public} "
        "python SCRIPT",
        "",
        "Secret files (*.key_secret) are mode 0600: keep them so, and never copy one to any "
        "machine but its own. To add a worker, drop its NAME.key into the allow-list and "
        "restart the coordinator; to revoke one, delete its NAME.key and restart.",
    ]
    return "\n".join(lines)


def run_keys_command(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """Carry out a parsed ``epochal keys ...`` command; returns the exit status.

    Raises ConfigError (the CLI prints it and exits 2) when the keys cannot be written.
    """
    if args.keys_command == "generate":
        keys = generate(args.directory, workers=args.workers, names=args.names)
        print(deploy_text(keys), file=out if out is not None else sys.stdout, flush=True)
        return 0
    raise ConfigError(f"unknown keys action {args.keys_command!r}")


def add_coordinator_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--curve-key FILE`` and ``--curve-allowed DIR`` to a coordinator command."""
    g = parser.add_argument_group(
        "CURVE security (see `epochal keys generate --help`)",
        "Give both to encrypt the control plane and admit only allow-listed workers.",
    )
    g.add_argument(
        SERVER_KEY_FLAG,
        dest="curve_key",
        default=None,
        metavar="FILE",
        help="the coordinator's secret key file (coordinator.key_secret)",
    )
    g.add_argument(
        ALLOWED_FLAG,
        dest="curve_allowed",
        default=None,
        metavar="DIR",
        help="directory of the worker public keys (NAME.key) the coordinator admits",
    )


def server_security_from_args(args: argparse.Namespace) -> ServerSecurity | None:
    """The coordinator's CURVE settings from its flags; None when neither flag is given.

    Raises ConfigError when only one is given or a file fails to load: a coordinator asked for
    security never starts without it.
    """
    key, allowed = getattr(args, "curve_key", None), getattr(args, "curve_allowed", None)
    if key is None and allowed is None:
        return None
    if key is None:
        raise ConfigError(
            f"{ALLOWED_FLAG} needs {SERVER_KEY_FLAG} FILE too: the coordinator's secret key "
            "(coordinator.key_secret from `epochal keys generate DIR`)"
        )
    if allowed is None:
        raise ConfigError(
            f"{SERVER_KEY_FLAG} needs {ALLOWED_FLAG} DIR too: the directory of worker public "
            "keys to admit (DIR/allowed from `epochal keys generate DIR`)"
        )
    return ServerSecurity.from_paths(key, allowed)
