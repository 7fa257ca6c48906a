"""The data-plane store in real runs: it binds where it advertises (a loopback run opens no port
beyond loopback), and a stranger who writes into it cannot grow any process past a stated bound."""

from __future__ import annotations

import os
import re
import socket
import struct
import threading
from pathlib import Path

import pytest

from epochal.worker.dataplane.storeserver import budget
from tests.integration.conftest import (
    SCRIPTS,
    Spawner,
    marked_pids,
    standalone_run,
    wait_for_record,
)

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
    wait_for_record(tmp_path / "run", deadline=120, alive=proc)
    sockets = {pid: listening(pid) for pid in marked_pids(spawn.mark)}
    _, output = spawn.finish(proc, 120)  # its exit status is not what this test is about
    assert any(sockets.values()), "no listening socket found: the check would see nothing"
    loopback = ("0100007F:", "00000000000000000000000001000000:")
    wide = {pid: [a for a in found if not a.startswith(loopback)] for pid, found in sockets.items()}
    assert not any(wide.values()), f"listening beyond loopback: {wide}\n{output}"


def rss(pid: int) -> int:
    """The resident memory of ``pid`` in bytes (0 once it has ended)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def listener_of(port: int, pids: list[int]) -> int:
    """Which of ``pids`` listens on ``port``."""
    for pid in pids:
        try:
            if any(int(a.rsplit(":", 1)[1], 16) == port for a in listening(pid)):
                return pid
        except OSError:
            continue
    raise AssertionError(f"none of {pids} listens on port {port}")


VALIDATE, SET, QUEUE_PUSH = 0, 1, 14
"""TCPStore's request codes (torch's TCPStoreBackend.hpp): what a stranger sends by hand."""
MAGIC = 0x3C85F7CE
VALUE = 8 * 1024 * 1024  # the largest value torch's server takes


def flood(port: int, total: int, stop: threading.Event) -> int:
    """A stranger: write ``total`` bytes of keys outside any run's prefix (sets and queue pushes
    of 8 MiB values) into the store at ``port``, reconnecting whenever it drops us; the bytes
    the store took."""
    value = b"x" * VALUE
    sent = attempts = 0
    while sent < total and attempts < 200 and not stop.is_set():
        attempts += 1
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(bytes([VALIDATE]) + struct.pack("<I", MAGIC))
                while sent < total:
                    op = SET if (sent // VALUE) % 2 else QUEUE_PUSH
                    key = f"junk/{sent}".encode()
                    head = bytes([op]) + struct.pack("<Q", len(key)) + key
                    sock.sendall(head + struct.pack("<Q", VALUE) + value)
                    sent += VALUE
        except OSError:
            continue  # dropped at its cap, or refused: try again
    return sent


def test_a_stranger_filling_rank_0s_store_during_a_run_is_held_to_the_stated_bound(
    spawn: Spawner,
):
    # the store's process may hold its start-up footprint plus budget(2); the training process
    # none of what a stranger sends. Before, rank 0 itself kept all of it (204 MiB and counting).
    bound = budget(2) + 16 * 1024 * 1024  # resident pages the store touches besides its data
    run = standalone_run(spawn, "--epochs", "8", delay=0.05)
    run.wait_for_first_epoch(120)
    found = re.search(r"data-plane store at 127\.0\.0\.1:(\d+)", run.output)
    assert found, run.output
    port = int(found.group(1))
    pids = marked_pids(spawn.mark)
    store = listener_of(port, pids)
    before = {pid: rss(pid) for pid in pids}
    peak = dict(before)
    stop = threading.Event()
    sent: list[int] = []
    stranger = threading.Thread(target=lambda: sent.append(flood(port, 4 * budget(2), stop)))
    stranger.start()
    while stranger.is_alive():
        for pid in pids:
            peak[pid] = max(peak[pid], rss(pid))
        stranger.join(timeout=0.05)
    for pid in pids:
        peak[pid] = max(peak[pid], rss(pid))
    codes = [spawn.finish(worker, 180)[0] for worker in run.workers]
    code, output = run.finish_coordinator(60)
    assert code == 0 and codes == [0, 0], output
    grown = {pid: peak[pid] - before[pid] for pid in pids}
    assert grown[store] > budget(2) // 2, f"the stranger's data never reached the store: {grown}"
    assert all(g <= bound for g in grown.values()), (
        f"memory grew past {bound >> 20} MiB: "
        f"{ {pid: g >> 20 for pid, g in grown.items()} } MiB (the store is {store})"
    )
