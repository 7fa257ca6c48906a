"""Retried hellos recognised by their bytes, before anything in them is decoded.

A worker sends its hello again, unchanged, until it is answered: at a thousand workers each says
it several times while the coordinator is busy admitting the others. Decoding and checking a hello
costs tens of microseconds (its fingerprint is a digest, not the model's entries), hashing its
frame about one, so the coordinator keeps, per member of the rendezvous, a digest of the frame of
its last admitted hello and the hello decoded from it. A frame from that routing identity with the
same digest is that hello again: the run acts on the hello it already decoded, exactly as it would
on the same bytes decoded again, so every check (session binding, key, rendezvous rules) still
runs; only the decoding is skipped. Any other frame is decoded in full.

Only members are remembered, one digest and one hello each (the rendezvous holds that hello
anyway): a stranger adds nothing here, and its frames are always decoded.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Container

from epochal.protocol import Hello


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


class HelloRetries:
    """The digest of each member's last admitted hello frame, and the hello it decoded to."""

    def __init__(self) -> None:
        self._by_peer: dict[bytes, tuple[int, bytes, Hello, str]] = {}

    def __len__(self) -> int:
        return len(self._by_peer)

    def match(self, peer: bytes, data: bytes | memoryview, size: int) -> tuple[Hello, str] | None:
        """The hello ``data`` (``size`` bytes) says and the session it presents, when it is the
        frame ``peer``'s hello was last admitted from; None: decode it."""
        known = self._by_peer.get(peer)
        if known is None or known[0] != size:
            return None
        if not hmac.compare_digest(_digest(data), known[1]):
            return None
        return known[2], known[3]

    def admitted(
        self, peer: bytes, data: bytes | memoryview, size: int, hello: Hello, session: str
    ) -> None:
        """``hello`` and ``session``, decoded from ``data`` (``size`` bytes), were admitted for
        ``peer``."""
        self._by_peer[peer] = (size, _digest(data), hello, session)

    def forget(self, peer: bytes) -> None:
        self._by_peer.pop(peer, None)

    def prune(self, members: Container[bytes], most: int) -> None:
        """Forget the peers no longer in ``members`` once more than ``most`` are remembered (a
        worker dropped during the rendezvous): at most ``most`` stay, each a member."""
        if len(self._by_peer) > most:
            self._by_peer = {p: v for p, v in self._by_peer.items() if p in members}
