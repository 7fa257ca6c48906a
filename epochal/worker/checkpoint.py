"""Checkpoints that a kill at any instant cannot break.

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP): every rank takes part,
replicated tensors are written once, and the same format holds optimizer state sharded across
ranks (ZeRO, FSDP2). Each rank also writes its own small file with every random-number generator it
uses, so a resumed run draws the same numbers as one that never stopped.

A checkpoint is written into ``epoch-NNNNNN.tmp-RUNID/``; when DCP's collective save has returned,
rank 0 writes ``MANIFEST.json`` (the SHA-256 of every file), fsyncs, and renames the directory to
``epoch-NNNNNN/``, then tells the coordinator, which journals the commit. A kill before the rename
leaves only a temporary directory that nobody reads; the previous checkpoint stays loadable.

Every load checks the checkpoint against its manifest first (:class:`CheckpointCorrupt` names the
file that differs), so damaged bytes are never loaded into a model, whichever epoch it is. Each
rank's own file also carries the learning curve up to that epoch, so a resumed run returns the
whole curve.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from epochal.errors import EpochalError
from epochal.manifest import MANIFEST, checkpoint_path, file_digest, verify_checkpoint
from epochal.worker import faults
from epochal.worker.state import Stateful


def rng_state() -> dict[str, Any]:
    """Every generator a training loop commonly draws from, as plain picklable data."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if cuda_ready:
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointCorrupt(EpochalError):
    """A checkpoint does not match its manifest: nothing was loaded from it."""


class Checkpointer:
    """Saves and loads one rank's part of the run's checkpoints under ``directory``."""

    def __init__(self, directory: Path, *, rank: int, run_id: str) -> None:
        self.directory = directory
        self.rank = rank
        self.run_id = run_id

    def save(self, epoch: int, state: Stateful, *, history: Any = None) -> Path | None:
        """Collective: write ``state`` (a DCP Stateful) for ``epoch``; rank 0 commits it.

        ``history`` (plain picklable data: the learning curve so far) is kept with this rank's
        generators and returned by :meth:`load`. Returns the committed path on rank 0, None
        elsewhere.
        """
        final = checkpoint_path(self.directory, epoch)
        tmp = final.with_name(f"{final.name}.tmp-{self.run_id}")
        tmp.mkdir(parents=True, exist_ok=True)
        own = tmp / f"rank{self.rank:05d}.pt"
        with open(own, "wb") as f:
            torch.save({"rng": rng_state(), "epoch": epoch, "history": history}, f)
            f.flush()
            os.fsync(f.fileno())
        from torch.distributed.checkpoint import save  # type: ignore[attr-defined]  # ~1 s import

        save({"app": state}, checkpoint_id=tmp)  # returns on rank 0 once every rank wrote
        if self.rank != 0:
            return None
        files = {
            str(p.relative_to(tmp)): file_digest(p) for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            json.dump({"epoch": epoch, "files": files}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        faults.hit("checkpoint-commit", rank=self.rank, epoch=epoch)
        if final.exists():  # an uncommitted leftover of an earlier attempt at this epoch
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        for stale in self.directory.glob("epoch-*.tmp-*"):
            if stale != tmp:
                shutil.rmtree(stale, ignore_errors=True)
        return final

    def load(self, epoch: int, state: Stateful, *, rng: bool = True) -> Any:
        """Collective: load ``epoch``'s checkpoint into ``state`` and (by default) the RNGs.

        The checkpoint is first checked against its manifest; a mismatch raises
        :class:`CheckpointCorrupt` before anything is loaded (every rank reads the same files, so
        every rank raises). Returns the ``history`` saved with it (None when ``rng`` is False).
        """
        path = checkpoint_path(self.directory, epoch)
        if not (path / MANIFEST).exists():
            raise EpochalError(
                f"the checkpoint of epoch {epoch} is missing at {path}: every rank must see the "
                "checkpoint directory (a shared file system when workers run on several machines)"
            )
        own = path / f"rank{self.rank:05d}.pt"
        if rng and not own.exists():
            raise EpochalError(
                f"{own} is missing: the run was checkpointed with fewer ranks; resume it "
                "with the world size it was started with"
            )
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointCorrupt(f"the checkpoint of epoch {epoch} is unusable: {problem}")
        from torch.distributed.checkpoint import load  # type: ignore[attr-defined]

        load({"app": state}, checkpoint_id=path)
        if not rng:
            return None
        extra = torch.load(own, weights_only=False)
        set_rng_state(extra["rng"])
        return extra.get("history")
