"""The checkpoint directory's layout and manifest, shared by who writes and who verifies.

Workers write ``epoch-NNNNNN/`` directories with a ``MANIFEST.json`` listing the SHA-256 of every
file (:mod:`epochal.worker.checkpoint`); the coordinator checks them against it before it
resumes from one (:mod:`epochal.coordinator.resume`), without torch. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "MANIFEST.json"


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


def verify_checkpoint(path: Path) -> str | None:
    """None when the checkpoint at ``path`` matches its manifest, else what is wrong with it."""
    manifest = path / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError(f"its files entry is a {type(files).__name__}, not an object")
    except FileNotFoundError:
        return f"{manifest} is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest} is unreadable ({exc})"
    for name, digest in files.items():
        target = path / name
        try:
            actual = file_digest(target)
        except OSError as exc:
            return f"{target} is unreadable ({exc.strerror})"
        if actual != digest:
            return f"{target} does not match its manifest (corrupt or truncated)"
    return None
