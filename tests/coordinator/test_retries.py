"""Retried hellos known by their bytes: which frames match, and what is remembered."""

from __future__ import annotations

from epochal.coordinator.rules.retries import HelloRetries
from epochal.protocol import encode
from tests.conftest import hello


def test_only_the_same_bytes_from_the_same_peer_are_the_same_hello():
    retries = HelloRetries()
    first = hello("a")
    data = encode(first)
    retries.admitted(b"a", memoryview(data), len(data), first, "")
    assert retries.match(b"a", data, len(data)) == (first, "")
    assert retries.match(b"b", data, len(data)) is None  # another peer
    flipped = bytearray(data)
    flipped[-1] ^= 1  # same length, one bit changed
    assert retries.match(b"a", memoryview(flipped), len(flipped)) is None
    changed = encode(hello("a", pid=2))
    assert retries.match(b"a", changed, len(changed)) is None
    retries.admitted(b"a", changed, len(changed), hello("a", pid=2), "")
    assert retries.match(b"a", data, len(data)) is None  # only the last admitted one, per peer
    assert len(retries) == 1


def test_peers_no_longer_in_the_rendezvous_are_forgotten_past_the_world_size():
    retries = HelloRetries()
    for peer in (b"a", b"b", b"c"):
        data = encode(hello(peer.decode()))
        retries.admitted(peer, data, len(data), hello(peer.decode()), "")
    retries.prune({b"a", b"c"}, most=3)
    assert len(retries) == 3  # not over the world size: nothing to do
    retries.prune({b"a", b"c"}, most=2)
    assert len(retries) == 2
    data = encode(hello("b"))
    assert retries.match(b"b", data, len(data)) is None
