"""A run's directories, checked before anything in them is read, deleted or written, and before
any worker starts: each bad one is refused with one line naming it and what to do.

The run directory is the coordinator's: created mode 0700 when missing (missing parents too),
refused when another user could control it (:func:`epochal.rundir.files.private_dir`), and tried by
making a file in it and removing it at once, so that a directory the coordinator cannot write (a
read-only file system, a mode without write permission) is refused at the start rather than at the
first record. The checkpoint directory is the workers': where they run on this machine (``epochal
run``) it is made and tried the same way; otherwise it is checked only when this machine sees it,
since a directory on another machine's disk is checked by the workers that write it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from epochal.errors import ConfigError
from epochal.rundir.files import (
    UnsafePath,
    check_private_dir,
    create_exclusive,
    private_dir,
    remove,
)

RUN_DIR_FLAG = "--run-dir"
CHECKPOINT_DIR_FLAG = "--checkpoint-dir"


def check_directories(
    run_dir: Path | None, checkpoint_dir: Path | None, *, workers_here: bool = False
) -> None:
    """Make the run directory (and, with ``workers_here``, the checkpoint directory) or refuse
    it; refuse a checkpoint directory seen from here that another user could write in."""
    if run_dir is not None:
        usable_dir(run_dir, kind="run directory", flag=RUN_DIR_FLAG)
    if checkpoint_dir is None:
        return
    if workers_here:
        usable_dir(checkpoint_dir, kind="checkpoint directory", flag=CHECKPOINT_DIR_FLAG)
    elif os.path.lexists(checkpoint_dir):
        check_private_dir(checkpoint_dir, kind="checkpoint directory")


def usable_dir(path: Path, *, kind: str, flag: str) -> Path:
    """``path`` made a private directory (:func:`~epochal.rundir.files.private_dir`) in which this
    process can create files; a ConfigError naming it, why not and ``flag`` otherwise."""
    try:
        private_dir(path, kind=kind)
    except UnsafePath as exc:
        if os.path.lexists(path):
            raise  # it is there, and not the user's alone: the message says what to do
        raise UnsafePath(f"{exc}; pass {flag} a directory you can create") from None
    probe = path / f".epochal-probe-{secrets.token_hex(8)}"
    try:
        os.close(create_exclusive(probe))
    except OSError as exc:
        raise ConfigError(
            f"cannot write in the {kind} {path} ({exc.strerror or exc}): make it writable, or "
            f"pass {flag} a directory you can write in"
        ) from None
    remove(probe)
    return path
