"""The files epochal writes and reads, safe on a machine other users share.

A run directory, a checkpoint directory and the key files are the user's alone: another local
user who could create them, plant a symbolic link in them or swap a file in them could make a run
overwrite the victim's own files, or feed it data it trusts. So:

- :func:`private_dir` creates a directory with mode 0700 (and any missing parents likewise), and
  uses an existing one only when it is a real directory (not a symbolic link) owned by this user
  and not writable by group or others; anything else is a :class:`UnsafePath` naming the path
  and what to do;
- :func:`write_atomic` writes a whole file through a temporary file created exclusively
  (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) under an unguessable name, fsyncs it and renames
  it into place: a link planted at the final name is replaced, never followed;
- :func:`open_append` opens a log to append to without following a link, and only when it is a
  regular file of this user's;
- :func:`read_regular` reads a file only when it is a regular file, up to a size bound, without
  following a link and without blocking on a FIFO: an onlooker (``epochal status``, ``epochal
  plot``) is not hung, flooded or redirected by what a directory holds.

Standard library only: the coordinator, the workers and the observers all use it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Any

from epochal.errors import ConfigError

DIR_MODE = 0o700
"""Mode of every directory epochal creates."""

FILE_MODE = 0o600
"""Mode of every file epochal writes."""

_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePath(ConfigError):
    """A directory or file that another user could control; the message says what to do."""


def _owner_problem(path: Path, st: os.stat_result, kind: str) -> str | None:
    """What makes ``st`` (of ``path``) unsafe to use as this user's ``kind``; None if nothing."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return (
            f"{path} belongs to another user (uid {st.st_uid}, this process runs as uid {uid}): "
            f"that user could change what the run reads and writes there. Use a {kind} of your "
            "own (a path no one else can create, not a shared scratch directory's top level)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        return (
            f"{path} is writable by {who} (mode {stat.filemode(st.st_mode)}): anyone who may "
            "write there could plant links or replace files."
            f" Run `chmod go-w {path}`, or use another {kind}"
        )
    return None


def check_private_dir(path: Path, *, kind: str = "directory") -> None:
    """Raise :class:`UnsafePath` unless ``path`` is a directory (not a link) of this user's that
    neither group nor others may write. ``kind`` names it in the message ("run directory")."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafePath(f"the {kind} {path} does not exist") from None
    except OSError as exc:
        raise UnsafePath(f"cannot use {path} as the {kind}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(
            f"the {kind} {path} is a symbolic link: another user may have planted it; give the "
            "real path of a directory of your own"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"the {kind} {path} exists and is not a directory: use another path")
    problem = _owner_problem(path, st, kind)
    if problem is not None:
        raise UnsafePath(f"refusing the {kind}: {problem}")


def private_dir(path: Path | str, *, kind: str = "directory") -> Path:
    """``path`` as a directory only this user controls: created with mode 0700 (missing parents
    too) or, when it exists, checked by :func:`check_private_dir`. Returns the path."""
    path = Path(path)
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile: checked below (the leaf) like any existing directory
        except OSError as exc:
            raise UnsafePath(
                f"cannot create the {kind} {path}: {exc.strerror or exc} at {directory}"
            ) from None
        with contextlib.suppress(OSError):
            os.chmod(directory, DIR_MODE, follow_symlinks=False)  # the umask may have narrowed it
    check_private_dir(path, kind=kind)
    return path


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_exclusive(path: Path) -> int:
    """A new file at ``path``, mode 0600, opened for writing: never an existing file or a link
    (``FileExistsError`` then). Returns the descriptor."""
    fd = os.open(path, _WRITE_FLAGS, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomic(path: Path | str, data: bytes | str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` in one step, never through a link: a reader sees the old file
    or the new one, mode 0600. ``durable``: fsync the file and its directory (the journal's and
    the checkpoint's files); an observer's snapshot may skip that."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = _temporary(path)
    fd = create_exclusive(tmp)
    try:
        with open(fd, "wb") as f:
            f.write(raw)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(path.parent)


def _check_own_file(path: Path, fd: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} is not a regular file: remove it, or use another directory")
    if st.st_uid != os.geteuid():
        raise UnsafePath(
            f"refusing to write {path}: it belongs to another user (uid {st.st_uid}); remove it, "
            "or use a directory of your own"
        )


def open_append(path: Path | str) -> IO[str]:
    """``path`` opened to append text, created with mode 0600 if missing; never through a link,
    and only a regular file of this user's (:class:`UnsafePath` otherwise)."""
    path = Path(path)
    try:
        fd = os.open(path, _APPEND_FLAGS, FILE_MODE)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePath(
                f"{path} is a symbolic link: another user may have planted it; remove it"
            ) from None
        raise exc
    try:
        _check_own_file(path, fd)
        os.fchmod(fd, FILE_MODE)
        return open(fd, "a", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise


class NotRegular(OSError):
    """A file that is not a regular file, or is larger than the reader's bound."""


def read_regular(path: Path | str, limit: int) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes.

    Never follows a link at ``path``, never blocks on a FIFO, never reads more than ``limit + 1``
    bytes (a file that grows while read is refused too). Raises ``FileNotFoundError`` when it is
    missing and :class:`NotRegular` (an ``OSError``) when it is a link, a device, a FIFO, a
    directory or too large.
    """
    path = Path(path)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if os.path.islink(path):
            raise NotRegular(f"{path} is a symbolic link") from None
        raise exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{path} is not a regular file")
        if st.st_size > limit:
            raise NotRegular(f"{path} is {st.st_size} bytes, over the {limit} this reader takes")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise NotRegular(f"{path} grew past the {limit} bytes this reader takes")
        return data
    finally:
        os.close(fd)


def read_text_regular(path: Path | str, limit: int) -> str:
    """:func:`read_regular` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_regular(path, limit).decode("utf-8", errors="replace")


def remove(path: Path | str) -> None:
    """Remove ``path`` if it is there (a link is removed, never followed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def open_private_binary(path: Path | str) -> Any:
    """A new file at ``path`` (mode 0600, exclusively created, never through a link), open for
    binary writing; ``FileExistsError`` when anything is already there."""
    return open(create_exclusive(Path(path)), "wb")
