"""What the coordinator's service tests share: a ZeroMQ context closed after each test, and
``serve``, a coordinator started on it and run as a task of the test's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.observe import RunObserver


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def serve(
    ctx: zmq.asyncio.Context,
    observers: RunObserver | None = None,
    *,
    attempt: int = 0,
    **config: object,
) -> tuple[Coordinator, asyncio.Task[Any]]:
    """A coordinator of 2 workers and 2 epochs unless ``config`` says otherwise, bound to a free
    loopback port, silent, telling ``observers``; it runs until the test aborts it."""
    cfg = CoordinatorConfig(**{"world_size": 2, "epochs": 2, **config})  # type: ignore[arg-type]
    coordinator = Coordinator(
        cfg, context=ctx, log=lambda line: None, observers=observers, attempt=attempt
    )
    await coordinator.start()
    return coordinator, asyncio.create_task(coordinator.run())
