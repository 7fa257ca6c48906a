"""Strangers' connections against a real run: idle, past the open-files limit, holding frames,
sending a message that never ends.

Each test starts ``epochal coordinator`` and two workers (``resumable.py``), waits for the first
epoch, and then opens raw connections that finish ZeroMQ's handshake and never say hello
(:mod:`tests.security.crowd`). The run must finish; the coordinator must drop the connections
within its bounds: after ``--heartbeat-timeout`` for each, and past its cap at once.
"""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path

import pytest

from epochal.coordinator.rules.holding import GIVE_BACK_INTERVAL, hold_limits
from epochal.coordinator.serve.connections import CONNECTION_BYTES, connection_limits
from epochal.coordinator.serve.router import RECEIVE_HWM
from epochal.protocol import MAX_FRAME_BYTES
from tests.integration.conftest import Spawner, StandaloneRun
from tests.security.crowd import Crowd, own_files, zmtp_dealer
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DELAY = 0.05
EPOCH = 18 * DELAY
"""The least an epoch of resumable.py takes: 16 training and 2 validation batches, each sleeping
DELAY."""
TICK = 0.1
"""The coordinator looks at its clock at least this often."""
SLACK = 5.0
"""Seconds from a drop's due time to the peer seeing its connection closed, on a loaded 2-core
machine: the turn that notices it, the shutdown, libzmq's close."""
DEADLINE = 180.0
MIB = 1024 * 1024
ALLOWANCE_MIB = 32
"""The coordinator's own growth while a test runs beside its run (its epochs, its journal) and the
allocator's rounding: the bound the hostile tests of frames that never end allow."""
LIMITED_COORDINATOR = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.executable, [sys.executable, '-m', 'epochal', *sys.argv[2:]])"
)
"""``python -c`` code that runs ``epochal ARGS`` under an open-files limit of N (soft and hard, so
that the coordinator cannot raise it): ``-c CODE N ARGS``."""


class _FilesLimited:
    """A Spawner whose ``epochal`` runs under an open-files limit; the workers run as usual."""

    def __init__(self, spawn: Spawner, files: int) -> None:
        self._spawn = spawn
        self._files = files

    def epochal(self, *args: str, **env: str):
        return self._spawn.start("-c", LIMITED_COORDINATOR, str(self._files), *args, **env)

    def __getattr__(self, name: str):
        return getattr(self._spawn, name)


def _run(spawn, *, epochs: int, heartbeat_timeout: float) -> StandaloneRun:
    run = StandaloneRun(
        spawn,
        2,
        "--epochs",
        str(epochs),
        "--heartbeat-timeout",
        str(heartbeat_timeout),
    )
    run.start_workers(delay=DELAY)
    run.wait_for_first_epoch()
    return run


def _finished(run: StandaloneRun, epochs: int) -> str:
    code, output = run.finish_coordinator(DEADLINE)
    assert code == 0, output
    assert f"finished after {epochs} epochs" in output, output
    assert "run aborted" not in output, output
    for worker in run.workers:
        assert worker.wait(timeout=DEADLINE) == 0
    return output


def _going(run: StandaloneRun) -> bool:
    """Whether the run is still going: not over, so its connections are not closed by its end."""
    return run.coordinator.poll() is None and not (run.run_dir / "result.json").exists()


def _peak_rss_mib(pid: int, field: str = "VmHWM") -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None, status
    return int(match.group(1)) / 1024


def _rss_mib(pid: int) -> float:
    return _peak_rss_mib(pid, "VmRSS")


def test_connections_that_never_say_hello_are_dropped_after_the_heartbeat_timeout(spawn):
    timeout = 3.0
    # the run outlasts the bound on any machine: epochs take at least EPOCH each
    epochs = 2 + int((timeout + TICK + SLACK) / EPOCH)
    run = _run(spawn, epochs=epochs, heartbeat_timeout=timeout)
    limits = connection_limits(
        workers=2, timeout=timeout, frame_bytes=MAX_FRAME_BYTES, files=_open_files(run)
    )
    count = min(limits.cap, 80)  # within the cap, which would drop some at once
    crowd = Crowd(run.endpoint)
    try:
        crowd.open(count - count // 2)  # ZMTP's handshake done, then silence
        crowd.open(count // 2, handshake=False)  # not even the handshake
        crowd.wait(time.monotonic() + timeout + TICK + SLACK, all_closed=True)
        assert _going(run), "the run ended before the bound: make it longer"
        assert crowd.open_count == 0, f"{crowd.open_count} connections still open"
        held = [crowd.closed[i] - crowd.opened[i] for i in range(len(crowd.socks))]
        assert min(held) >= timeout, f"a connection was dropped after {min(held):.2f} s"
    finally:
        crowd.close()
    output = _finished(run, epochs)
    assert f"that did not join within {timeout:g} s" in output, output
    spawn.assert_none_left()


def test_more_idle_connections_than_the_open_files_limit_mid_run(spawn):
    files, strangers, timeout = 1024, 1100, 3.0
    epochs = 2 + int((timeout + TICK + SLACK) / EPOCH)
    run = _run(_FilesLimited(spawn, files), epochs=epochs, heartbeat_timeout=timeout)
    crowd = Crowd(run.endpoint)
    try:
        with own_files(strangers + 256):
            crowd.open(strangers)
            crowd.wait(time.monotonic() + timeout + TICK + SLACK, all_closed=True)
            assert _going(run), "the run ended before the bound: make it longer"
            assert crowd.open_count == 0, f"{crowd.open_count} connections still open"
    finally:
        crowd.close()
    output = _finished(run, epochs)
    named = [line for line in output.splitlines() if f"open-files limit ({files})" in line]
    named += [line for line in output.splitlines() if f"open-files limit is {files}" in line]
    assert len(named) == 1, output  # said once, with the real limit
    assert "ulimit -n" not in output, output  # the two workers are not the cause: no advice
    spawn.assert_none_left()


def test_connections_holding_partial_frames_are_bounded_in_number_and_memory(spawn):
    """Strangers fill the coordinator with frames they never finish before the workers come;
    the workers still join (the oldest strangers make room); once the strangers leave, the
    memory they held is given back while the run goes on, and the run finishes."""
    strangers, wave = 2000, 200
    epochs = 3 + int((GIVE_BACK_INTERVAL + SLACK) / EPOCH)  # outlasts the hand-back
    timeout = 60.0  # beyond the attack: every drop it sees is for the cap
    run = StandaloneRun(spawn, 2, "--epochs", str(epochs), "--heartbeat-timeout", str(timeout))
    limits = connection_limits(
        workers=2, timeout=timeout, frame_bytes=MAX_FRAME_BYTES, files=_open_files(run)
    )
    before = _peak_rss_mib(run.coordinator.pid)
    crowd = Crowd(run.endpoint)
    try:
        with own_files(strangers + 256):
            began = time.monotonic()
            for first in range(0, strangers, wave):
                crowd.open(wave)
                crowd.send_partial(first, MAX_FRAME_BYTES)  # all of the largest frame but a byte
                crowd.wait(time.monotonic() + DEADLINE, sent=True)
            # the drops of the last wave come as the coordinator reads its monitor's events
            crowd.wait(time.monotonic() + SLACK)
            assert time.monotonic() - began < timeout, "the attack outlasted the timeout"
            peak = _peak_rss_mib(run.coordinator.pid)
            capped = crowd.closed
            assert len(capped) >= strangers - limits.cap, (len(capped), limits)
            run.start_workers(delay=DELAY)  # while the rest of the crowd holds its frames
            run.wait_for_first_epoch()
            crowd.close()
            wait_until(
                lambda: _rss_mib(run.coordinator.pid) <= before + ALLOWANCE_MIB,
                GIVE_BACK_INTERVAL + SLACK,
                lambda: (
                    f"RSS {_rss_mib(run.coordinator.pid):.0f} MiB after the strangers left, "
                    f"{before:.0f} before they came"
                ),
                TICK,
            )
            assert _going(run), "the run ended before the memory was given back: make it longer"
            output = _finished(run, epochs)
    finally:
        crowd.close()
    held = limits.cap * (MAX_FRAME_BYTES + CONNECTION_BYTES) / MIB  # what the cap assumes
    assert peak < before + held + ALLOWANCE_MIB, f"peak RSS {peak:.0f} MiB, before {before:.0f}"
    assert f"more than {limits.cap} connections are open" in output, output
    spawn.assert_none_left()


def _open_files(run: StandaloneRun) -> int | None:
    """The coordinator's soft open-files limit, as it raised it."""
    for line in Path(f"/proc/{run.coordinator.pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft = line.split()[3]
            return None if soft == "unlimited" else int(soft)
    raise AssertionError("no open-files limit in /proc/PID/limits")


def test_a_message_that_never_ends_is_cut_off_and_the_run_finishes(spawn):
    """Mid-run, a connection without the token sends 64 KiB frames flagged "more" without end,
    and connects again each time it is dropped. libzmq would hold all of it (one such connection
    took the coordinator to 1,024 MiB in 4 s before this bound); the coordinator drops each one
    at its next look, within a turn of its clock, so what it holds at once is what one or two
    connections sent before their drop, however long the attack goes on."""
    attack, timeout = 3.0, 15.0
    epochs = 2 + int((attack + TICK + SLACK) / EPOCH)
    run = _run(spawn, epochs=epochs, heartbeat_timeout=timeout)
    before = _peak_rss_mib(run.coordinator.pid)
    burst = (b"\x03" + struct.pack(">Q", MAX_FRAME_BYTES) + bytes(MAX_FRAME_BYTES)) * 16
    poured: list[int] = []  # the bytes each connection sent before its drop
    end = time.monotonic() + attack
    while time.monotonic() < end:
        conn = zmtp_dealer(run.endpoint)
        conn.settimeout(TICK + SLACK)  # a coordinator that stopped reading fails the test too
        began, sent = time.monotonic(), 0
        try:
            while True:
                sent += conn.send(burst)
                held = time.monotonic() - began
                assert held < TICK + SLACK, f"not dropped after {held:.1f} s and {sent} bytes"
        except (ConnectionResetError, BrokenPipeError):
            pass  # dropped
        finally:
            conn.close()
        poured.append(sent)
    peak = _peak_rss_mib(run.coordinator.pid)
    assert _going(run), "the run ended before the attack did: make it longer"
    assert len(poured) >= 2, "the first connection was never dropped"
    limits = hold_limits(RECEIVE_HWM, secured=False)
    # dropped only past the limit: the tighter one when the service had read every finished
    # message (no worker's frames were queued), else the looser one
    assert min(poured) > limits.drained, poured
    limit = limits.queued
    # the connection being poured into and the one dropped before it, at most
    bound = before + (2 * max(poured) + limit) / MIB + ALLOWANCE_MIB
    assert peak < bound, f"peak RSS {peak:.0f} MiB, before {before:.0f}: {poured}"
    output = _finished(run, epochs)
    assert "of a message it had not finished" in output, output
    assert f"{len(poured)} that held an unfinished message" in output, output
    print(
        f"{len(poured)} connections dropped, each after at most {max(poured) / MIB:.0f} MiB, "
        f"{sum(poured) / MIB:.0f} MiB in all; peak RSS {before:.0f} -> {peak:.0f} MiB"
    )
    spawn.assert_none_left()
