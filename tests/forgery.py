"""A checkpoint forged as a user without the checkpoint key can: a file swapped for a pickle that
runs code, its SHA-256 recomputed in the manifest. The worker's unit tests and the security tests
both hold that such a checkpoint is refused before a byte of it is unpickled."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import torch


class RunsCode:
    """A pickle that creates ``marker`` when it is loaded: what a forger plants."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def forge(checkpoint: Path, name: str, marker: Path) -> None:
    """Swap ``name`` in ``checkpoint`` for code (:class:`RunsCode` on ``marker``), and recompute
    its SHA-256 in the manifest (no key needed)."""
    if name == ".metadata":  # DCP reads it with pickle.load
        data = pickle.dumps(RunsCode(marker))
    else:  # a rank's own file, which torch.load reads
        buffer = io.BytesIO()
        torch.save(RunsCode(marker), buffer)
        data = buffer.getvalue()
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    manifest["files"][name] = hashlib.sha256(data).hexdigest()
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
