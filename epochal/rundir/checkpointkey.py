"""The per-user key that signs checkpoint manifests: where it lives, made once, read with care.

A checkpoint's ``MANIFEST.json`` carries an HMAC-SHA256 under this key
(:mod:`epochal.rundir.manifest`); nothing in a checkpoint is read before that MAC verifies, so
whoever lacks the key cannot make a checkpoint that epochal loads. Where the key comes from:

- ``EPOCHAL_CHECKPOINT_KEY_FILE`` (:data:`~epochal.environment.CHECKPOINT_KEY_FILE_ENV`) names a
  key file that must exist: a copy of one key on every machine of a run, or a mounted secret;
- otherwise ``$XDG_CONFIG_HOME/epochal/checkpoint.key`` (``~/.config/epochal/checkpoint.key``),
  made on first use in a directory of mode 0700. The configuration directory, not the state one:
  the key is a credential to copy to the run's other machines and to keep (losing it makes every
  checkpoint unusable), which is what XDG says configuration is and state is not (state is what
  may stay on one machine and may be lost).

A key file holds 64 hex digits (32 random bytes) and a newline. It is used only when it is a
regular file of this user's that no one else may read (mode 0600 or narrower), or one of root's
that its group may read at most (0640): a Kubernetes Secret mounted for the pod's ``fsGroup``.
This is PostgreSQL's rule for its server key. Standard library only: the coordinator uses it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from epochal.environment import CHECKPOINT_KEY_FILE_ENV
from epochal.errors import ConfigError
from epochal.rundir.files import UnsafePath, create_exclusive, private_dir

KEY_FILE_NAME = "checkpoint.key"
"""The key file's name in epochal's configuration directory."""

KEY_BYTES = 32
"""A key's length: 256 bits, HMAC-SHA256's block-size-safe key length."""

_KEY_FILE_LIMIT = 4096
_KEY_ID_LABEL = b"epochal checkpoint key id\n"
_MAKE_ONE = (
    "(umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > FILE), or copy "
    "~/.config/epochal/checkpoint.key from the machine that made the run's checkpoints"
)


@dataclass(frozen=True, slots=True)
class CheckpointKey:
    """A checkpoint key and the file it came from."""

    secret: bytes = field(repr=False)
    # the 32 bytes HMAC-SHA256 is keyed with
    path: Path
    # where it was read, named in messages

    @property
    def key_id(self) -> str:
        """A short name of the key that tells two keys apart and reveals nothing of it."""
        return hmac.new(self.secret, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:16]

    def describe(self) -> str:
        """How a message names this key: ``id ... (PATH)``."""
        return f"id {self.key_id} ({self.path})"


def default_key_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/epochal/checkpoint.key``, else ``~/.config/epochal/checkpoint.key``
    (a relative ``XDG_CONFIG_HOME`` is ignored, as the XDG specification says)."""
    env = os.environ if environ is None else environ
    config = env.get("XDG_CONFIG_HOME", "")
    if config and os.path.isabs(config):
        return Path(config) / "epochal" / KEY_FILE_NAME
    try:
        home = Path.home()
    except RuntimeError:  # no HOME, and no passwd entry (a container's arbitrary uid)
        raise ConfigError(
            f"this process has no home directory for its checkpoint key: set "
            f"{CHECKPOINT_KEY_FILE_ENV} to a key file. Make one: {_MAKE_ONE}"
        ) from None
    return home / ".config" / "epochal" / KEY_FILE_NAME


def key_file_problem(st: os.stat_result, euid: int) -> str | None:
    """What makes a key file with status ``st`` unfit for a process of ``euid``; None if nothing.

    Mode 0600 or narrower when it is this user's; when root owns it (and this is not root), its
    group may read it (0640 or narrower). Anything else could be read or replaced by others."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == euid:
        if mode & 0o077:
            return (
                f"is readable or writable by others (mode {mode:04o}): anyone who reads it can "
                "forge checkpoints. Run `chmod 600` on it"
            )
        return None
    if st.st_uid == 0:
        if mode & 0o037:
            return (
                f"is root's with mode {mode:04o}: only its owner may write it and at most its "
                "group read it (0640)"
            )
        return None
    return (
        f"belongs to another user (uid {st.st_uid}; this process runs as uid {euid}): that user "
        "could forge checkpoints. Use a key file of your own"
    )


def _parse(raw: bytes, path: Path) -> bytes:
    text = raw.decode("ascii", errors="replace").strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != KEY_BYTES:
        raise ConfigError(
            f"the checkpoint key file {path} does not hold {KEY_BYTES * 2} hex digits: it is "
            f"damaged or not a key file. Make one: {_MAKE_ONE}"
        )
    return secret


def read_key_file(path: Path) -> CheckpointKey:
    """The key in ``path``, checked by :func:`key_file_problem` on the file it opened (a link is
    followed: a mounted Secret's files are links); ``FileNotFoundError`` when it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(
            f"cannot read the checkpoint key file {path}: {exc.strerror or exc}; make it "
            "readable by the user this process runs as"
        ) from None
    try:
        problem = key_file_problem(os.fstat(fd), os.geteuid())
        if problem is not None:
            raise UnsafePath(f"refusing the checkpoint key file {path}: it {problem}")
        raw = os.read(fd, _KEY_FILE_LIMIT + 1)
    finally:
        os.close(fd)
    if len(raw) > _KEY_FILE_LIMIT:
        raise ConfigError(f"the checkpoint key file {path} is too large to be a key file")
    return CheckpointKey(secret=_parse(raw, path), path=path)


def create_key_file(path: Path) -> CheckpointKey:
    """A new random key at ``path`` (mode 0600), or the one another process made there first.

    The key is written whole to a temporary file created exclusively, then hard-linked to
    ``path``, which fails if anything is there already: no reader sees half a key, and two
    processes starting together end up with one key."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = create_exclusive(tmp)
    try:
        with open(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # made meanwhile: that one is the key
            os.link(tmp, path)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the checkpoint key file {path}: {exc.strerror or exc}; set "
            f"{CHECKPOINT_KEY_FILE_ENV} to a key file instead. Make one: {_MAKE_ONE}"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return read_key_file(path)


def load_key(environ: Mapping[str, str] | None = None) -> CheckpointKey:
    """This user's checkpoint key: the file ``EPOCHAL_CHECKPOINT_KEY_FILE`` names (which must
    exist), else the one in epochal's configuration directory, made there on first use."""
    env = os.environ if environ is None else environ
    given = env.get(CHECKPOINT_KEY_FILE_ENV, "")
    if given:
        path = Path(given)
        try:
            return read_key_file(path)
        except FileNotFoundError:
            raise ConfigError(
                f"{CHECKPOINT_KEY_FILE_ENV}={given} does not exist: give every process of the "
                f"run the same key file. Make one: {_MAKE_ONE}"
            ) from None
    path = default_key_path(env)
    try:
        private_dir(path.parent, kind="epochal configuration directory")
    except UnsafePath as exc:
        raise UnsafePath(
            f"{exc}; or set {CHECKPOINT_KEY_FILE_ENV} to a checkpoint key file elsewhere"
        ) from None
    try:
        return read_key_file(path)
    except FileNotFoundError:
        return create_key_file(path)
