"""CURVE key files: generate a coordinator's and its workers' key pairs, and load them back.

The files are ZeroMQ certificates as ``zmq.auth.create_certificates`` writes them: ``NAME.key``
holds a public key, ``NAME.key_secret`` the public and the secret key. ``generate`` lays a key
directory out by where each file must go::

    DIR/                            mode 0700
    ├── coordinator.key_secret      the coordinator's secret key: its machine only (mode 0600)
    ├── coordinator.key             the coordinator's public key: every worker machine
    ├── allowed/                    worker public keys: the coordinator's allow-list directory
    │   └── worker-0.key
    └── workers/                    worker secret keys, one per worker machine (mode 0600)
        └── worker-0.key_secret

Every loader validates what it reads (a 40-character Z85 key, a secret that belongs to its public
key) and turns each failure into a :class:`~epochal.errors.ConfigError` that names the file and
the fix. A coordinator whose keys do not load does not start: it never runs with a silently
empty allow-list.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from epochal.errors import ConfigError

PUBLIC_SUFFIX = ".key"
"""File name ending of a public key file (what ``zmq.auth.create_certificates`` writes)."""

SECRET_SUFFIX = ".key_secret"
"""File name ending of a secret key file; it holds the public key too."""

COORDINATOR_NAME = "coordinator"
"""Base name of the coordinator's key files."""

ALLOWED_DIR = "allowed"
"""Subdirectory of a generated key directory holding the worker public keys (the allow-list)."""

WORKERS_DIR = "workers"
"""Subdirectory of a generated key directory holding the worker secret keys."""

SECRET_MODE = 0o600
DIR_MODE = 0o700

KEY_LENGTH = 40
"""Length of a Z85-encoded CURVE key (32 bytes)."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

_GENERATE_HINT = "generate keys with `epochal keys generate DIR`"


@dataclass(frozen=True, slots=True)
class KeyDirectory:
    """What :func:`generate` wrote, file by file."""

    root: Path
    coordinator_secret: Path
    # the coordinator's secret key file: stays on the coordinator's machine
    coordinator_public: Path
    # the coordinator's public key file: copied to every worker machine
    allowed: Path
    # directory of worker public keys: the coordinator's allow-list
    worker_secrets: dict[str, Path]
    # worker name -> its secret key file: each copied to that worker's machine only


# ---------------------------------------------------------------------- generating


def _check_names(workers: int, names: Sequence[str] | None) -> list[str]:
    if names is None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be an integer >= 1, got {workers!r}")
        return [f"worker-{i}" for i in range(workers)]
    chosen = list(names)
    if not chosen:
        raise ConfigError("names is empty: name at least one worker")
    for name in chosen:
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise ConfigError(
                f"worker name {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if name == COORDINATOR_NAME:
            raise ConfigError(f"a worker cannot be named {COORDINATOR_NAME!r}: pick another name")
    duplicates = sorted({n for n in chosen if chosen.count(n) > 1})
    if duplicates:
        raise ConfigError(f"worker names must be unique; repeated: {', '.join(duplicates)}")
    return chosen


def _make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, exist_ok=True)
    os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask; the exact mode is wanted


def _create_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """``zmq.auth.create_certificates``, with the secret file 0600 from its first byte.

    pyzmq opens the secret file with the process umask (usually 0644). The file is created here
    first, empty and 0600, so pyzmq's ``open(..., "w")`` truncates a file that was never readable
    by anyone else; the final chmod pins the mode whatever the umask.
    """
    secret = directory / f"{name}{SECRET_SUFFIX}"
    os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_MODE))
    public_file, secret_file = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_file, SECRET_MODE)
    return Path(public_file), Path(secret_file)


def generate(
    directory: str | os.PathLike[str],
    *,
    workers: int = 1,
    names: Sequence[str] | None = None,
) -> KeyDirectory:
    """Write a coordinator key pair and one key pair per worker into a new key directory.

    ``names`` names the workers (their files are ``NAME.key`` / ``NAME.key_secret``); without it
    there are ``workers`` of them, ``worker-0`` ... ``worker-{N-1}``. ``directory`` must not exist
    or be empty: keys are never overwritten (to rotate keys, generate a new directory, deploy it,
    and delete the old one — a stale worker key left in an allow-list would still be admitted).
    """
    chosen = _check_names(workers, names)
    if not zmq.has("curve"):
        raise ConfigError(
            "this libzmq was built without CURVE support: install a pyzmq wheel (which bundles "
            "a libzmq with CURVE) or a libzmq built with libsodium"
        )
    root = Path(directory)
    if root.exists():
        if not root.is_dir():
            raise ConfigError(f"{root} exists and is not a directory: name a new directory")
        owner = root.stat().st_uid
        if owner != os.geteuid():
            raise ConfigError(
                f"{root} belongs to another user (uid {owner}): that user could read or replace "
                "the keys written into it; name a new directory, or one of your own"
            )
        if any(root.iterdir()):
            raise ConfigError(
                f"{root} is not empty: keys are never overwritten; name a new directory (to "
                "rotate keys, generate a new directory and deploy it in place of the old one)"
            )
    try:
        root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(root, DIR_MODE)
        allowed = root / ALLOWED_DIR
        secrets = root / WORKERS_DIR
        _make_private_dir(allowed)
        _make_private_dir(secrets)
        coordinator_public, coordinator_secret = _create_pair(root, COORDINATOR_NAME)
        worker_secrets: dict[str, Path] = {}
        for name in chosen:
            public, secret = _create_pair(secrets, name)
            # the public half goes to the allow-list; the secret file still holds it
            os.replace(public, allowed / public.name)
            worker_secrets[name] = secret
    except OSError as exc:
        raise ConfigError(f"cannot write keys to {root}: {exc}") from None
    return KeyDirectory(
        root=root,
        coordinator_secret=coordinator_secret,
        coordinator_public=coordinator_public,
        allowed=allowed,
        worker_secrets=worker_secrets,
    )


# ---------------------------------------------------------------------- loading


def _check_key(value: bytes, path: Path, what: str) -> bytes:
    try:
        if len(value) != KEY_LENGTH:
            raise ValueError
        decoded = z85.decode(value)
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{path}: the {what} is not a CURVE key (expected {KEY_LENGTH} Z85 characters): the "
            f"file is damaged or was edited; {_GENERATE_HINT} and deploy the new files"
        ) from None
    if len(decoded) != 32:
        raise ConfigError(f"{path}: the {what} does not decode to 32 bytes; {_GENERATE_HINT}")
    return value


def _read(path: str | os.PathLike[str], role: str, hint: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a certificate file, or a ConfigError saying what is wrong."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{role} file {file} does not exist: {hint}")
    if file.is_dir():
        raise ConfigError(f"{role} file {file} is a directory, not a key file: {hint}")
    try:
        public, secret = zmq.auth.load_certificate(file)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"cannot read {role} file {file}: {reason}; make it readable by the user this "
            "process runs as"
        ) from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"{file} is not a CURVE key file (no public-key line): {hint}") from None
    public = _check_key(public, file, "public key")
    if secret is not None:
        secret = _check_key(secret, file, "secret key")
        if zmq.curve_public(secret) != public:
            raise ConfigError(
                f"{file}: its public and secret keys do not belong together (the file was "
                f"edited or damaged); {_GENERATE_HINT} and deploy the new files"
            )
    return public, secret


def _load_pair(path: str | os.PathLike[str], role: str, hint: str) -> tuple[bytes, bytes]:
    public, secret = _read(path, role, hint)
    if secret is None:
        raise ConfigError(
            f"{role} file {path} holds only a public key: pass the {SECRET_SUFFIX} file "
            f"(which holds both keys), not the {PUBLIC_SUFFIX} file"
        )
    return public, secret


def load_server_keys(secret_file: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """The coordinator's (public, secret) key pair, Z85-encoded, from its ``.key_secret`` file."""
    return _load_pair(
        secret_file,
        "coordinator secret key",
        f"pass the {COORDINATOR_NAME}{SECRET_SUFFIX} that `epochal keys generate DIR` wrote",
    )


def load_client_keys(secret_file: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """A worker's (public, secret) key pair, Z85-encoded, from its ``.key_secret`` file."""
    return _load_pair(
        secret_file,
        "worker secret key",
        f"pass this worker's DIR/{WORKERS_DIR}/NAME{SECRET_SUFFIX} from "
        "`epochal keys generate DIR`",
    )


def load_public(
    file: str | os.PathLike[str], *, role: str = "public key", hint: str | None = None
) -> bytes:
    """The public key, Z85-encoded, from a ``.key`` file.

    A file that also holds a secret key is refused: public keys are what gets copied around, and
    a secret key found among them is a secret that has already travelled too far.
    """
    public, secret = _read(
        file, role, hint or f"pass a {PUBLIC_SUFFIX} file written by `epochal keys generate DIR`"
    )
    if secret is not None:
        raise ConfigError(
            f"{file} holds a secret key, where only a public key belongs: use the matching "
            f"{PUBLIC_SUFFIX} file, and keep {SECRET_SUFFIX} files on their own machine"
        )
    return public


def load_coordinator_public(file: str | os.PathLike[str]) -> bytes:
    """The coordinator's public key, as a worker loads it (messages say which file is meant)."""
    return load_public(
        file,
        role="coordinator public key",
        hint=f"pass the {COORDINATOR_NAME}{PUBLIC_SUFFIX} from the coordinator's key directory",
    )


def load_allowed(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """Every worker public key (Z85) in ``directory/*.key``: the coordinator's allow-list.

    A missing or unreadable directory, one without any ``*.key`` file, or any file in it that is
    not a public key raises ConfigError: the coordinator stops with that message rather than
    starting with an allow-list that refuses everyone (or admits fewer workers than intended).
    """
    root = Path(directory)
    hint = (
        f"pass the {ALLOWED_DIR}/ directory that `epochal keys generate DIR` wrote, or a "
        f"directory of worker NAME{PUBLIC_SUFFIX} files"
    )
    if not root.exists():
        raise ConfigError(f"allow-list directory {root} does not exist: {hint}")
    if not root.is_dir():
        raise ConfigError(f"allow-list {root} is not a directory: {hint}")
    try:
        files = sorted(p for p in root.iterdir() if p.name.endswith(PUBLIC_SUFFIX))
    except OSError as exc:
        raise ConfigError(f"cannot list allow-list directory {root}: {exc.strerror}") from None
    if not files:
        raise ConfigError(
            f"allow-list directory {root} holds no worker public keys (*{PUBLIC_SUFFIX}): the "
            f"coordinator would refuse every worker; {hint}"
        )
    return frozenset(load_public(f, role="worker public key", hint=hint) for f in files)
