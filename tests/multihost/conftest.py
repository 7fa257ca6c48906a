"""Fixtures for tests across hosts: ``hosts(n)`` builds n network-namespace hosts for one test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from tests.multihost import netns


@pytest.fixture
def make_hosts() -> Iterator[Callable[[int], netns.Network]]:
    """``make_hosts(3)`` -> a Network of 3 hosts, torn down (processes killed) after the test."""
    reason = netns.available()
    if reason is not None:
        pytest.skip(reason)
    with ExitStack() as stack:

        def make(count: int) -> netns.Network:
            return stack.enter_context(netns.hosts(count))

        yield make
