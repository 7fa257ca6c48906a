"""The data-plane store: bound to the chosen address, its keys under the run's secret."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import PrefixStore, TCPStore

from epochal.environment import PRELOAD_SOCKET_ENV
from epochal.log import ensure_configured
from epochal.worker.dataplane import storeserver
from epochal.worker.dataplane.store import StoreServer, connect_store, new_key, open_store, scoped
from epochal.worker.joinoptions import JoinOptions
from tests.forked import ForkedProcess
from tests.waiting import wait_until

STORE_TIMEOUT = JoinOptions().collective_timeout
"""The worker's own bound for the store (its collective timeout): the store's process imports
torch before it serves, which a loaded machine can stretch well past 10 s."""


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) that listen on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_torchs_own_store_listens_everywhere_ours_on_the_chosen_address():
    plain = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert listening_addresses(plain.port) <= {"00000000", "00000000000000000000000000000000"}
    ours = open_store("127.0.0.1", STORE_TIMEOUT)
    assert listening_addresses(ours.port) == {"0100007F"}  # 127.0.0.1 only
    peer = connect_store("127.0.0.1", ours.port, STORE_TIMEOUT)
    peer.set("k", b"v")
    assert ours.get("k") == b"v"


def test_without_the_secret_no_rendezvous_key_is_read_or_planted():
    server = open_store("127.0.0.1", STORE_TIMEOUT)
    key = new_key()
    assert len(key) == 32 and key != new_key()
    rank0 = scoped(server, "run1", key)
    rank0.set("0", b"rank 0 listens at 127.0.0.1:1234")
    # a stranger knows the run id (it is in run.json) and the port, not the secret
    stranger_client = connect_store("127.0.0.1", server.port, STORE_TIMEOUT)
    stranger = PrefixStore("epochal/run1", stranger_client)
    stranger.set_timeout(timedelta(seconds=0.2))
    assert not stranger.check(["0"])
    stranger.set("0", b"the attacker's address")
    assert rank0.get("0") == b"rank 0 listens at 127.0.0.1:1234"
    member = scoped(connect_store("127.0.0.1", server.port, STORE_TIMEOUT), "run1", key)
    assert member.get("0") == b"rank 0 listens at 127.0.0.1:1234"


def test_an_address_of_another_machine_falls_back_to_every_interface(capfd):
    # 192.0.2.1 (TEST-NET-1) is nobody's address: advertised through a NAT, say. Only bound here.
    ensure_configured()  # as a worker's session does before it opens the store
    store = open_store("192.0.2.1", STORE_TIMEOUT)
    assert listening_addresses(store.port) == {"00000000"}
    assert "is not an address of this machine" in capfd.readouterr().err


def test_a_torch_whose_libuv_store_refuses_a_listening_socket_gets_the_other_backend():
    calls = []

    def older_torch(*args, **kwargs):  # as torch before 2.8 did for master_listen_fd
        calls.append(kwargs.get("use_libuv", True))
        if kwargs.get("use_libuv", True):
            raise NotImplementedError("masterListenFd is not supported by the libuv backend")
        return TCPStore(*args, **kwargs)

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ours = storeserver.serve(listener.detach(), "127.0.0.1", port, STORE_TIMEOUT, store=older_torch)
    assert calls == [True, False]
    assert not ours.libuvBackend
    assert listening_addresses(port) == {"0100007F"}
    peer = connect_store("127.0.0.1", port, STORE_TIMEOUT)
    peer.set("k", b"v")
    assert ours.get("k") == b"v"


@pytest.mark.parametrize(
    ("world", "mib"),
    [(None, 64), (2, 64.03), (1000, 94.9), (10_000, 1746.1)],
)
def test_the_stores_budget_is_stated_per_world_size(world: int | None, mib: float):
    assert storeserver.budget(world) / 2**20 == pytest.approx(mib, abs=0.1)


@pytest.mark.slow  # the store server is a process that imports torch
def test_the_store_server_runs_apart_capped_and_its_cap_grows_with_the_world():
    server = StoreServer.start("127.0.0.1", 60)
    try:
        assert server.process.pid != os.getpid()
        soft, _ = resource.prlimit(server.process.pid, resource.RLIMIT_DATA)
        assert soft == server.limit == server.baseline + storeserver.budget(None)
        server.expect(1000)
        soft, _ = resource.prlimit(server.process.pid, resource.RLIMIT_DATA)
        assert soft == server.limit == server.baseline + storeserver.budget(1000)
        assert listening_addresses(server.port) == {"0100007F"}
    finally:
        server.close()
    assert server.process.returncode == 0


STARTER = """\
import time
from epochal.worker.dataplane.store import StoreServer
server = StoreServer.start('127.0.0.1', 60)
print(server.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # the store server is a process that imports torch
def test_the_store_server_ends_when_the_process_that_started_it_is_killed(tmp_path: Path):
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    starter: Any
    if os.environ.get(PRELOAD_SOCKET_ENV):
        # forked from the session's preloaded process, with no channel of its own to it: it asks
        # that process for its store server as a worker started by hand does
        starter = ForkedProcess(
            [str(script)], env=os.environ, cwd=tmp_path, channel_of_its_own=False
        )
    else:  # EPOCHAL_TEST_FRESH: none to ask, the server is an interpreter of its own too
        starter = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        pid = int(starter.stdout.readline())
    finally:
        starter.kill()
        starter.communicate()
    wait_until(  # it notices at once; the margin is for a loaded machine
        lambda: not (Path(f"/proc/{pid}").exists() and "(python" in stat(pid)),
        30,
        "the store server outlived the process that started it",
    )


def stat(pid: int) -> str:
    """/proc/PID/stat, or "" once the process is gone (a zombie's is kept until it is reaped)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return "" if text.split(")")[-1].split()[0] == "Z" else text
