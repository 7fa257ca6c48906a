"""A run's directories are made, checked and tried at the start (coordinator/serve/directories.py).

A directory that cannot be made or written is refused with one line naming it, why and the flag
to change; nothing is left behind by the trial. Refusals for another user's directory are in
tests/security/test_run_directory.py, and for a read-only file system, as processes, in
tests/integration/test_bad_input.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from epochal.coordinator.serve.directories import check_directories, usable_dir
from epochal.errors import ConfigError


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_run_directory_is_made_private_and_tried_without_a_trace(tmp_path: Path):
    check_directories(tmp_path / "a" / "run", None)
    assert mode(tmp_path / "a" / "run") == mode(tmp_path / "a") == 0o700
    assert list((tmp_path / "a" / "run").iterdir()) == []  # the trial file is gone


def test_the_checkpoint_directory_is_made_only_where_the_workers_run(tmp_path: Path):
    checkpoints = tmp_path / "run" / "checkpoints"
    check_directories(tmp_path / "run", checkpoints)
    assert not checkpoints.exists()  # another machine's disk, perhaps: the workers check it
    check_directories(tmp_path / "run", checkpoints, workers_here=True)
    assert mode(checkpoints) == 0o700 and list(checkpoints.iterdir()) == []


@pytest.mark.parametrize(
    ("kind", "flag"),
    [("run directory", "--run-dir"), ("checkpoint directory", "--checkpoint-dir")],
)
def test_a_directory_that_cannot_be_made_is_refused_naming_the_flag(
    tmp_path: Path, kind: str, flag: str
):
    (tmp_path / "file").write_text("")
    wanted = tmp_path / "file" / "sub"  # under a file: no one can make it, root neither
    with pytest.raises(ConfigError) as refused:
        if flag == "--run-dir":
            check_directories(wanted, None)
        else:
            check_directories(tmp_path / "run", wanted, workers_here=True)
    message = str(refused.value)
    assert message == (
        f"cannot create the {kind} {wanted}: Not a directory at {wanted}; pass {flag} a "
        "directory you can create"
    )


def test_a_path_that_is_a_file_is_refused(tmp_path: Path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        usable_dir(tmp_path / "file", kind="run directory", flag="--run-dir")
