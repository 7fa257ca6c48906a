"""Which connection speaks for which admitted worker: one session per worker, checked per frame.

A routing identity says nothing about who sent a frame: any process that can reach the socket may
connect under any identity. So when a hello is admitted the coordinator issues that worker a random
session secret (in its Joined and Welcome) and remembers, under CURVE, the public key its hello
came with (the ZAP user id). Every later frame from that routing identity must present the same
secret, compared in constant time, and come from the same key; a frame that does not is dropped
and never acts for the worker, so a process without the secret can neither fail the run nor
answer for rank 0.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

SESSION_BYTES = 32
"""Random bytes per session secret (43 characters once base64url-encoded)."""


@dataclass(frozen=True, slots=True)
class Binding:
    """What a frame from one admitted worker must show."""

    secret: str
    user_id: str
    # the ZAP user id (the CURVE public key, Z85) the hello came with; "" without CURVE


class Sessions:
    """Session secrets of the admitted workers, by routing identity."""

    def __init__(self) -> None:
        self._by_peer: dict[bytes, Binding] = {}

    def __contains__(self, peer: bytes) -> bool:
        return peer in self._by_peer

    def issue(self, peer: bytes, user_id: str) -> str:
        """The session of ``peer``: a new one at its first admission, the same one after."""
        binding = self._by_peer.get(peer)
        if binding is None:
            binding = Binding(secrets.token_urlsafe(SESSION_BYTES), user_id)
            self._by_peer[peer] = binding
        return binding.secret

    def same_sender(self, peer: bytes, user_id: str) -> bool:
        """Whether a hello from ``peer`` may speak for the worker bound to it (if any)."""
        binding = self._by_peer.get(peer)
        return binding is None or hmac.compare_digest(binding.user_id, user_id)

    def check(self, peer: bytes, secret: str, user_id: str) -> bool:
        """Whether a frame from ``peer`` carries its worker's session and comes from its key."""
        binding = self._by_peer.get(peer)
        if binding is None:
            return False
        ok_secret = hmac.compare_digest(binding.secret.encode(), secret.encode())
        ok_user = hmac.compare_digest(binding.user_id.encode(), user_id.encode())
        return ok_secret and ok_user

    def forget(self, peer: bytes) -> None:
        """Drop the session of a worker that left before the run started."""
        self._by_peer.pop(peer, None)
