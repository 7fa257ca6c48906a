"""A loopback run opens no port beyond loopback: the data-plane store binds where it advertises."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.integration.conftest import SCRIPTS, Spawner, marked_pids

pytestmark = pytest.mark.slow


def listening(pid: int) -> list[str]:
    """The local addresses ("hexaddr:hexport") of the TCP sockets ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(fields[1])
    return found


def test_a_loopback_run_listens_on_loopback_only(spawn: Spawner, tmp_path):
    out = tmp_path / "out"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(out),
        "--delay",
        "0.1",  # long enough epochs to look at the sockets while they train
    )
    epochs = tmp_path / "run" / "epochs.jsonl"
    deadline = time.monotonic() + 120
    while not (epochs.exists() and epochs.read_text().strip()):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the run did not reach its first epoch"
        time.sleep(0.1)
    sockets = {pid: listening(pid) for pid in marked_pids(spawn.mark)}
    _, output = spawn.finish(proc, 120)  # its exit status is not what this test is about
    assert any(sockets.values()), "no listening socket found: the check would see nothing"
    loopback = ("0100007F:", "00000000000000000000000001000000:")
    wide = {pid: [a for a in found if not a.startswith(loopback)] for pid, found in sockets.items()}
    assert not any(wide.values()), f"listening beyond loopback: {wide}\n{output}"
