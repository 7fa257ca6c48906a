"""The checkpoint directory's layout and its signed manifest, shared by who writes and who verifies.

Workers write ``epoch-NNNNNN/`` directories whose ``MANIFEST.json`` lists the SHA-256 of every file
and carries an HMAC-SHA256 of that list, of the epoch and of the key's id under the user's
checkpoint key (:mod:`epochal.rundir.checkpointkey`); the workers
(:mod:`epochal.worker.checkpoints.checkpoint`) check a checkpoint against it before DCP or
``torch.load`` reads any byte of it, and the coordinator before it resumes from one
(:mod:`epochal.coordinator.serve.resume`), without torch.

What a check refuses, naming the file: a manifest that is missing, unreadable, unsigned (written
before checkpoints were authenticated), signed with another key or altered (the MAC does not
verify), of another epoch (a checkpoint moved or copied), and a file whose bytes differ from the
manifest's sum (damaged, truncated or swapped). Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from epochal.environment import CHECKPOINT_KEY_FILE_ENV
from epochal.errors import EpochalError
from epochal.rundir.checkpointkey import CheckpointKey
from epochal.rundir.files import NotRegular, create_exclusive, read_regular

MANIFEST = "MANIFEST.json"

FORMAT = 2
"""The manifest's format: 2 is signed; the unsigned one before it had no ``format`` field."""

MANIFEST_LIMIT = 64 << 20
"""The largest manifest read back (about 300,000 files' sums)."""

_MAC_LABEL = b"epochal checkpoint manifest\n"
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ManifestError(EpochalError):
    """A checkpoint that does not verify against its manifest; the message names the file."""


def checkpoint_path(checkpoint_dir: Path, epoch: int) -> Path:
    """Where the committed checkpoint of ``epoch`` lives."""
    return checkpoint_dir / f"epoch-{epoch:06d}"


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _own_file_digest(path: Path) -> str:
    """SHA-256 of a checkpoint's file: a regular file, never read through a link."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if os.path.islink(path):
            raise NotRegular(f"{path} is a symbolic link") from None
        raise exc
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(f"{path} is not a regular file")
        h = hashlib.sha256()
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _mac(body: dict[str, Any], key: CheckpointKey) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key.secret, _MAC_LABEL + canonical.encode("ascii"), hashlib.sha256).hexdigest()


def signed(body: dict[str, Any], key: CheckpointKey) -> dict[str, Any]:
    """``body`` with its ``hmac_sha256``: HMAC-SHA256 under ``key`` of a fixed label and the
    body as compact JSON with sorted keys (what :func:`read_manifest` recomputes)."""
    return {**body, "hmac_sha256": _mac(body, key)}


def write_manifest(directory: Path, epoch: int, key: CheckpointKey) -> None:
    """Sum every file under ``directory`` and write the signed ``MANIFEST.json`` beside them:
    created exclusively (never an existing file or a link), mode 0600, fsynced."""
    files = {
        str(p.relative_to(directory)): _own_file_digest(p)
        for p in sorted(directory.rglob("*"))
        if p.name != MANIFEST and stat.S_ISREG(p.lstat().st_mode)
    }
    body = {"format": FORMAT, "epoch": epoch, "files": files, "key_id": key.key_id}
    with open(create_exclusive(directory / MANIFEST), "w", encoding="utf-8") as f:
        json.dump(signed(body, key), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _load(manifest: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_regular(manifest, MANIFEST_LIMIT))
    except FileNotFoundError:
        raise ManifestError(f"{manifest} is missing") from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{manifest} is unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{manifest} is unreadable (a {type(data).__name__}, not an object)")
    return data


def read_manifest(path: Path, key: CheckpointKey, *, epoch: int) -> dict[str, str]:
    """The files (name -> SHA-256) of the checkpoint at ``path``, once its manifest's MAC verifies
    under ``key`` and says ``epoch``; :class:`ManifestError` otherwise. Reads the manifest only."""
    manifest = path / MANIFEST
    data = _load(manifest)
    mac = data.pop("hmac_sha256", None)
    if mac is None:
        raise ManifestError(
            f"{manifest} has no MAC: the checkpoint predates authenticated checkpoints (or was "
            "written by someone without the key), and an unsigned checkpoint cannot be told from "
            "a forged one, so nothing of it is loaded"
        )
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(data, key)):
        theirs = data.get("key_id")
        if isinstance(theirs, str) and theirs != key.key_id:
            raise ManifestError(
                f"{manifest} is signed with another checkpoint key (id {theirs[:16]!r}) than this "
                f"process's, {key.describe()}: a checkpoint of another user's run, a forged one, "
                "or a process of this run with another key (every process of a run must read "
                f"the same key: a shared home, or {CHECKPOINT_KEY_FILE_ENV})"
            )
        raise ManifestError(
            f"{manifest} does not verify under the checkpoint key {key.describe()}: the "
            "manifest was altered or forged"
        )
    files = data.get("files")
    if data.get("format") != FORMAT or not isinstance(files, dict):
        raise ManifestError(f"{manifest} is of a format this epochal does not read")
    if data.get("epoch") != epoch:
        raise ManifestError(
            f"{manifest} belongs to epoch {data.get('epoch')!r}, not {epoch}: the checkpoint was "
            "moved or copied from another epoch"
        )
    for name, digest in files.items():
        parts = PurePosixPath(name).parts
        if not isinstance(digest, str) or not parts or name.startswith("/") or ".." in parts:
            raise ManifestError(f"{manifest} lists {name!r}, which is not a checkpoint's file")
    return files


def check_files(path: Path, files: dict[str, str], *, needs: Iterable[str] = ()) -> None:
    """Raise :class:`ManifestError` unless every file ``files`` lists has its sum and the files
    ``needs`` names are among them (a file the manifest does not list is never read)."""
    for name in needs:
        if name not in files:
            raise ManifestError(f"{path / name} is not in {path / MANIFEST}")
    for name, digest in files.items():
        target = path / name
        try:
            actual = _own_file_digest(target)
        except OSError as exc:
            raise ManifestError(f"{target} is unreadable ({exc.strerror or exc})") from None
        if not hmac.compare_digest(actual, digest):
            raise ManifestError(
                f"{target} does not match its manifest (corrupt, truncated or replaced)"
            )


def verified_bytes(path: Path, name: str, files: dict[str, str], limit: int) -> bytes:
    """The bytes of ``path/name``, read once, when they are what the verified manifest lists:
    what is parsed is what was checked, even if the file changes meanwhile."""
    target = path / name
    try:
        data = read_regular(target, limit)
    except OSError as exc:
        raise ManifestError(f"{target} is unreadable ({exc.strerror or exc})") from None
    digest = files.get(name)
    if digest is None or not hmac.compare_digest(hashlib.sha256(data).hexdigest(), digest):
        raise ManifestError(
            f"{target} does not match its manifest (corrupt, truncated or replaced)"
        )
    return data


def verify_checkpoint(
    path: Path, key: CheckpointKey, *, epoch: int, needs: Iterable[str] = ()
) -> str | None:
    """None when the checkpoint of ``epoch`` at ``path`` verifies (its manifest's MAC under
    ``key``, then every file's sum), else what is wrong with it, naming the file."""
    try:
        check_files(path, read_manifest(path, key, epoch=epoch), needs=needs)
    except ManifestError as exc:
        return str(exc)
    return None
