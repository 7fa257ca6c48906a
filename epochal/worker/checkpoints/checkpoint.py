"""Checkpoints that a kill at any instant cannot break, and that no one without the key can forge.

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP): every rank takes part,
replicated tensors are written once, and the same format holds optimizer state sharded across
ranks (ZeRO, FSDP2). Each rank also writes its own small file with every random-number generator it
uses, so a resumed run draws the same numbers as one that never stopped.

A checkpoint is written into ``epoch-NNNNNN.tmp-RUNID/`` (mode 0700, in a checkpoint directory of
this user's that no one else may write: :func:`epochal.rundir.files.private_dir`); when DCP's
collective save has returned, rank 0 sets every file to mode 0600, writes ``MANIFEST.json`` (the
SHA-256 of every file, signed with the user's checkpoint key: :mod:`epochal.rundir.manifest`),
fsyncs, and renames the directory to ``epoch-NNNNNN/``, then tells the coordinator, which journals
the commit. A kill before the rename leaves only a temporary directory that nobody reads; the
previous checkpoint stays loadable. Every rank marks the temporary directory with its key's id, so
rank 0 stops the run at the first checkpoint when the ranks do not share one key.

Every load checks the checkpoint against its manifest first: the MAC, then every file's sum
(:class:`CheckpointCorrupt` names the file that differs), so neither damaged nor forged bytes reach
DCP's unpickler or ``torch.load``, whichever epoch it is. A rank's own file is then read once,
checked again, and loaded with ``weights_only=True``. Each rank's own file also carries the
learning curve up to that epoch, so a resumed run returns the whole curve.

Where rank 0's state is the whole state (a state marked
:class:`~epochal.worker.checkpoints.state.WholeOnRoot`), :meth:`Checkpointer.save_behind` lets
the next epoch train while the checkpoint is written: every rank writes its own file at the
boundary, rank 0 copies its state to host memory and writes it, as a one-rank DCP checkpoint that
any world loads, and commits it as above, on a thread
(:mod:`epochal.worker.checkpoints.asyncsave`). The other ranks may then begin the next
checkpoint's temporary directory before rank 0 commits this one, so a commit cleans up the
leftovers of its own epoch and earlier ones only.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from epochal.environment import CHECKPOINT_KEY_FILE_ENV
from epochal.errors import EpochalError
from epochal.rundir.checkpointkey import CheckpointKey, load_key
from epochal.rundir.files import (
    DIR_MODE,
    FILE_MODE,
    check_private_dir,
    create_exclusive,
    private_dir,
    remove,
)
from epochal.rundir.manifest import (
    MANIFEST,
    ManifestError,
    check_files,
    checkpoint_path,
    read_manifest,
    verified_bytes,
    write_manifest,
)
from epochal.worker import faults
from epochal.worker.checkpoints.asyncsave import (
    BackgroundSave,
    host_copy,
    quiet_single_process_note,
)
from epochal.worker.checkpoints.state import Stateful, whole_on_root

DCP_METADATA = ".metadata"
"""The file DCP reads first (a pickle): never before the manifest verifies."""

RANK_FILE_LIMIT = 256 << 20
"""The largest rank file read back (generators and the learning curve: kilobytes in practice)."""

_KEY_MARK = ".key-"
"""Prefix of the empty files by which each rank tells rank 0 its key's id."""


def rng_state() -> dict[str, Any]:
    """Every generator a training loop commonly draws from, in the types that
    ``torch.load(weights_only=True)`` reads back: tensors, tuples, lists, ints, floats, strings."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": (version, internal, gauss)}
    cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if cuda_ready:
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (str(kind), keys.tolist(), int(pos), int(has_gauss), float(cached))
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state(
            (kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached)
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_temporary(tmp: Path) -> None:
    """``tmp`` made by this rank (mode 0700), or, when another rank of the run made it first,
    used only as a directory of this user's that no one else may write."""
    try:
        os.mkdir(tmp, DIR_MODE)
    except FileExistsError:
        check_private_dir(tmp, kind="temporary checkpoint directory")
        return
    os.chmod(tmp, DIR_MODE, follow_symlinks=False)  # the umask may have narrowed it


def _private_modes(directory: Path) -> None:
    """Mode 0600 for every file DCP wrote (it writes with the umask), 0700 for directories."""
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), DIR_MODE, follow_symlinks=False)
        for name in files:
            path = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, FILE_MODE, follow_symlinks=False)


def _tmp_epoch(tmp: Path) -> int:
    """The epoch of a temporary checkpoint directory (``epoch-NNNNNN.tmp-RUNID``); -1 for a name
    of another form, which a later commit's clean-up removes too."""
    digits = tmp.name.removeprefix("epoch-").partition(".tmp-")[0]
    return int(digits) if digits.isdigit() else -1


class CheckpointCorrupt(EpochalError):
    """A checkpoint does not match its signed manifest: nothing was loaded from it."""


class Checkpointer:
    """Saves and loads one rank's part of the run's checkpoints under ``directory``.

    ``key`` signs and checks the manifests; default: :func:`epochal.rundir.checkpointkey.load_key`
    (``EPOCHAL_CHECKPOINT_KEY_FILE``, else the user's), read at the first save or load.
    """

    def __init__(
        self, directory: Path, *, rank: int, run_id: str, key: CheckpointKey | None = None
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.run_id = run_id
        self._key_given = key

    def _key(self) -> CheckpointKey:
        if self._key_given is None:
            self._key_given = load_key()
        return self._key_given

    def save(self, epoch: int, state: Stateful, *, history: Any = None) -> Path | None:
        """Collective: write ``state`` (a DCP Stateful) for ``epoch``; rank 0 commits it.

        ``history`` (plain data: the learning curve so far, as lists, dicts, strings and numbers)
        is kept with this rank's generators and returned by :meth:`load`; so is what a ``state``
        with ``rank_state()`` returns, handed back to its ``load_rank_state()``. Returns the
        committed path on rank 0, None elsewhere.
        """
        key = self._key()
        tmp = self._own_part(epoch, state, key, history)
        from torch.distributed.checkpoint import save  # type: ignore[attr-defined]  # ~1 s import

        save({"app": state}, checkpoint_id=tmp)  # returns on rank 0 once every rank wrote
        if self.rank != 0:
            return None
        return self._commit(epoch, tmp, key)

    def save_behind(
        self,
        epoch: int,
        state: Stateful,
        *,
        history: Any = None,
        then: Callable[[int], None] | None = None,
    ) -> BackgroundSave | None:
        """Collective: :meth:`save` with rank 0's writing and commit left to a thread, for a
        ``state`` whose rank 0 part is the whole state
        (:func:`~epochal.worker.checkpoints.state.whole_on_root`).

        Every rank writes its own file and takes ``state`` (collective: DDP's buffers come from
        rank 0) before a barrier, so that rank 0's commit finds every rank's file; rank 0 then
        writes a host copy of its state as a one-rank DCP checkpoint on the returned
        :class:`BackgroundSave`, which any world loads as it loads :meth:`save`'s, and calls
        ``then(epoch)`` on that thread once the commit is durable. None elsewhere.
        """
        if not whole_on_root(state):
            raise EpochalError(
                "a checkpoint is written behind training only where rank 0's state is the whole "
                "(replicated, main): save this one with save()"
            )
        key = self._key()
        tmp = self._own_part(epoch, state, key, history)
        taken = state.state_dict()  # every rank: the state may take part of it collectively
        copied = {"app": host_copy(taken)} if self.rank == 0 else None
        if dist.is_initialized():
            dist.barrier()  # on this thread: the writer runs no collective
        if copied is None:
            return None
        from torch.distributed.checkpoint import save  # type: ignore[attr-defined]  # ~1 s import

        quiet_single_process_note()

        def write() -> None:
            save(copied, checkpoint_id=tmp, no_dist=True)
            self._commit(epoch, tmp, key)

        return BackgroundSave(epoch, write, then)

    def _own_part(self, epoch: int, state: Stateful, key: CheckpointKey, history: Any) -> Path:
        """Every rank: the temporary directory of ``epoch``, with this rank's file (generators,
        ``history`` and what ``state`` holds of this rank's alone) and its key's mark in it."""
        private_dir(self.directory, kind="checkpoint directory")
        final = checkpoint_path(self.directory, epoch)
        tmp = final.with_name(f"{final.name}.tmp-{self.run_id}")
        _make_temporary(tmp)
        own = tmp / f"rank{self.rank:05d}.pt"
        remove(own)  # an earlier attempt's at this epoch
        with open(create_exclusive(own), "wb") as f:
            own_state = getattr(state, "rank_state", None)  # this rank's alone, e.g. its stream's
            rank_part = own_state() if callable(own_state) else None
            torch.save(
                {"rng": rng_state(), "epoch": epoch, "history": history, "rank": rank_part}, f
            )
            f.flush()
            os.fsync(f.fileno())
        mark = tmp / f"{_KEY_MARK}{self.rank:05d}-{key.key_id}"
        remove(mark)
        os.close(create_exclusive(mark))
        faults.hit("checkpoint-write", rank=self.rank, epoch=epoch)  # every rank, mid-write
        return tmp

    def _commit(self, epoch: int, tmp: Path, key: CheckpointKey) -> Path:
        """Rank 0, once every rank wrote into ``tmp``: sign its manifest and rename it into
        place; the rename is the commit."""
        final = checkpoint_path(self.directory, epoch)
        self._check_keys(tmp, key)
        _private_modes(tmp)
        remove(tmp / MANIFEST)  # an earlier attempt's at this epoch
        write_manifest(tmp, epoch, key)
        _fsync_dir(tmp)
        faults.hit("checkpoint-commit", rank=self.rank, epoch=epoch)
        if final.exists():  # an uncommitted leftover of an earlier attempt at this epoch
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        for stale in self.directory.glob("epoch-*.tmp-*"):
            if _tmp_epoch(stale) <= epoch:  # a later one may be the next checkpoint's, begun
                shutil.rmtree(stale, ignore_errors=True)
        return final

    def _check_keys(self, tmp: Path, key: CheckpointKey) -> None:
        """Rank 0: every rank marked ``tmp`` with ``key``'s id, or the run stops here, at its
        first checkpoint, rather than at a resume that every checkpoint would fail."""
        others: dict[str, list[str]] = {}
        for entry in os.scandir(tmp):
            if entry.name.startswith(_KEY_MARK):
                rank, _, key_id = entry.name.removeprefix(_KEY_MARK).partition("-")
                if key_id != key.key_id:
                    others.setdefault(key_id, []).append(str(int(rank)))
                os.unlink(entry.path)
        if others:
            ranks = "; ".join(f"rank(s) {', '.join(r)} use key id {k}" for k, r in others.items())
            raise EpochalError(
                f"the ranks do not share one checkpoint key: rank 0 uses {key.describe()}, "
                f"{ranks}. Every process of a run must read the same key: a home shared by the "
                f"machines, or {CHECKPOINT_KEY_FILE_ENV} naming a copy of one key on each"
            )

    def load(self, epoch: int, state: Stateful, *, rng: bool | None = True) -> Any:
        """Collective: load ``epoch``'s checkpoint into ``state`` and (by default) the RNGs;
        ``rng`` None: the RNGs where the checkpoint has this rank's, as its manifest says (a
        world larger than the checkpoint's, after an elastic change or a resume at another size).

        The checkpoint is first checked against its manifest (the MAC under this user's key,
        then every file); a mismatch raises :class:`CheckpointCorrupt` before anything is loaded
        (every rank reads the same files with the same key, so every rank raises). Returns the
        ``history`` saved with it (None when ``rng`` is False).
        """
        check_private_dir(self.directory, kind="checkpoint directory")
        path = checkpoint_path(self.directory, epoch)
        if not (path / MANIFEST).exists():
            raise EpochalError(
                f"the checkpoint of epoch {epoch} is missing at {path}: every rank must see the "
                "checkpoint directory (a shared file system when workers run on several machines)"
            )
        check_private_dir(path, kind="checkpoint")
        own = f"rank{self.rank:05d}.pt"
        key = self._key()
        try:
            files = read_manifest(path, key, epoch=epoch)
            if rng is None:  # the manifest is authenticated: a deleted rank file is not "none"
                rng = own in files
            check_files(path, files, needs=(DCP_METADATA, own) if rng else (DCP_METADATA,))
        except ManifestError as exc:
            raise CheckpointCorrupt(f"the checkpoint of epoch {epoch} is unusable: {exc}") from None
        from torch.distributed.checkpoint import load  # type: ignore[attr-defined]

        load({"app": state}, checkpoint_id=path)
        if not rng:
            return None
        try:
            data = verified_bytes(path, own, files, RANK_FILE_LIMIT)
        except ManifestError as exc:
            raise CheckpointCorrupt(f"the checkpoint of epoch {epoch} is unusable: {exc}") from None
        extra = torch.load(io.BytesIO(data), weights_only=True)
        set_rng_state(extra["rng"])
        if callable(load_own := getattr(state, "load_rank_state", None)):
            load_own(extra.get("rank"))
        return extra.get("history")
