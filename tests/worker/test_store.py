"""The data-plane store: bound to the chosen address, its keys under the run's secret."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from epochal.log import ensure_configured
from epochal.worker import store as store_module
from epochal.worker.store import connect_store, new_key, open_store, scoped


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
    ours = open_store("127.0.0.1", 10)
    assert listening_addresses(ours.port) == {"0100007F"}  # 127.0.0.1 only
    peer = connect_store("127.0.0.1", ours.port, 10)
    peer.set("k", b"v")
    assert ours.get("k") == b"v"


def test_without_the_secret_no_rendezvous_key_is_read_or_planted():
    server = open_store("127.0.0.1", 10)
    key = new_key()
    assert len(key) == 32 and key != new_key()
    rank0 = scoped(server, "run1", key)
    rank0.set("0", b"rank 0 listens at 127.0.0.1:1234")
    # a stranger knows the run id (it is in run.json) and the port, not the secret
    stranger_client = connect_store("127.0.0.1", server.port, 10)
    stranger = PrefixStore("epochal/run1", stranger_client)
    stranger.set_timeout(timedelta(seconds=0.2))
    assert not stranger.check(["0"])
    stranger.set("0", b"the attacker's address")
    assert rank0.get("0") == b"rank 0 listens at 127.0.0.1:1234"
    member = scoped(connect_store("127.0.0.1", server.port, 10), "run1", key)
    assert member.get("0") == b"rank 0 listens at 127.0.0.1:1234"


def test_an_address_of_another_machine_falls_back_to_every_interface(capfd):
    # 192.0.2.1 (TEST-NET-1) is nobody's address: advertised through a NAT, say. Only bound here.
    ensure_configured()  # as a worker's session does before it opens the store
    store = open_store("192.0.2.1", 10)
    assert listening_addresses(store.port) == {"00000000"}
    assert "is not an address of this machine" in capfd.readouterr().err


def test_a_torch_whose_libuv_store_refuses_a_listening_socket_gets_the_other_backend(
    monkeypatch: pytest.MonkeyPatch,
):
    calls = []

    def older_torch(*args, **kwargs):  # as torch before 2.8 did for master_listen_fd
        if "master_listen_fd" not in kwargs:  # a client: as any torch
            return TCPStore(*args, **kwargs)
        calls.append(kwargs.get("use_libuv", True))
        if kwargs.get("use_libuv", True):
            raise NotImplementedError("masterListenFd is not supported by the libuv backend")
        return TCPStore(*args, **kwargs)

    monkeypatch.setattr(store_module, "TCPStore", older_torch)
    ours = open_store("127.0.0.1", 10)
    assert calls == [True, False]
    assert listening_addresses(ours.port) == {"0100007F"}
    peer = connect_store("127.0.0.1", ours.port, 10)
    peer.set("k", b"v")
    assert ours.get("k") == b"v"
