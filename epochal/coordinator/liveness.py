"""Who has gone quiet: pure liveness checks that take the clock as an argument."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

K = TypeVar("K")


def expired(now: float, last_seen: float, timeout: float) -> bool:
    """True when nothing has been heard for longer than ``timeout`` seconds."""
    return now - last_seen > timeout


def lost(now: float, last_seen: Mapping[K, float], timeout: float) -> list[K]:
    """Every peer that has been silent for longer than ``timeout`` seconds, oldest first."""
    quiet = [(seen, peer) for peer, seen in last_seen.items() if expired(now, seen, timeout)]
    return [peer for _, peer in sorted(quiet, key=lambda item: item[0])]
