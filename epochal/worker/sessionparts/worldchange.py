"""A session that goes on in a new world when a rank is lost (an elastic run): it tells the
coordinator of a broken epoch, leaves the old process group (shutting its connections, so that a
collective blocked on a frozen peer raises at once), meets the next world and rebuilds over it.

:class:`WorldChange` owns the process group's connections and adopts the new world's welcome
into the session's :class:`~epochal.worker.sessionparts.standing.Standing`; a world that restores
a checkpoint has the session load it (:mod:`~epochal.worker.sessionparts.savepoints`) between
:meth:`WorldChange.move` and :meth:`WorldChange.arrived`. docs/elastic.md tells the whole story.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from epochal.errors import EpochalError
from epochal.log import WORKER
from epochal.protocol import Broken, Phase, Regroup, Restore, Welcome, clip
from epochal.worker.control.client import ControlClient
from epochal.worker.control.exits import failure_reason
from epochal.worker.control.worlds import Rejoin, leave_group, meet
from epochal.worker.dataplane.sockets import GroupSockets
from epochal.worker.dataplane.store import scoped
from epochal.worker.sessionparts.standing import Standing


@dataclass(frozen=True, slots=True)
class Moved:
    """This rank is in a new world: its welcome, and what the training loop's rebuild returned."""

    welcome: Welcome
    state: Any
    # the state a checkpoint holds from now on (None: the same as before)
    was: int
    # this rank's rank in the world it left
    started: float
    # time.monotonic() when it began to leave


class WorldChange:
    """Following a world change; see the module docstring."""

    def __init__(
        self,
        client: ControlClient,
        standing: Standing,
        device: torch.device,
        *,
        sockets: GroupSockets,
        endpoint: str,
        store_timeout: float,
    ) -> None:
        self._client = client
        self._standing = standing
        self._device = device
        self._sockets = sockets
        # the process group's connections, shut when this rank leaves it for a new world
        self._endpoint = endpoint  # where a new rank 0 advertises a store of its own
        self._store_timeout = store_timeout

    def broken(self, epoch: int, exc: Exception) -> Regroup:
        """The epoch failed (a collective, most likely, whose peer is gone): tell the
        coordinator, and wait for the new world it decides (or its abort, raised)."""
        reason = failure_reason(exc)
        generation = self._standing.generation
        self._sockets.shut()  # peers blocked in a collective with this rank raise too
        self._client.send(Broken(epoch=epoch, generation=generation, reason=clip(reason)))
        WORKER.info(
            f"epochal: rank {self._standing.rank}: epoch {epoch} broke ({reason}); waiting for "
            "the coordinator to form a new world"
        )
        while True:
            message = self._client.receive()
            if isinstance(message, Regroup) and message.generation > generation:
                return message

    def leave_now(self, regroup: Regroup) -> None:
        """In the control client's thread, as a new world is decided: shut this group's
        connections, so that a collective this rank is blocked in raises now (its peer may be
        frozen or cut off, and gloo has no abort); the main thread then follows the Regroup."""
        if regroup.generation > self._standing.generation:
            self._sockets.shut()

    def move(self, regroup: Regroup, rejoin: Rejoin | None, error: BaseException | None) -> Moved:
        """Leave the broken world (``error``: what broke the epoch, whose frames may hold the
        old group), meet the next, rebuild over it."""
        self._client.take_regroup(regroup)
        if rejoin is None:
            raise EpochalError(
                "a rank was lost and the run goes on without it, but this training loop cannot: "
                "pass rejoin= to Session.run_epochs (epochal.train does), or run without "
                "--min-workers"
            )
        started = time.monotonic()
        standing = self._standing
        was = standing.rank
        self._client.at(Phase.CONNECT, regroup.epoch)
        self._sockets.shut()
        rejoin.leave(error)
        leave_group()
        welcome, standing.store = meet(
            self._client,
            regroup,
            standing.store,
            endpoint=self._endpoint,
            timeout=self._store_timeout,
        )
        standing.adopt(welcome)
        self._client.rank = standing.rank
        self._join(welcome)
        self._client.at(Phase.SETUP, welcome.start_epoch)
        return Moved(welcome, rejoin.rebuild(welcome.start_epoch), was, started)

    def arrived(self, moved: Moved) -> None:
        """Log the new world, once its start is restored."""
        welcome, standing = moved.welcome, self._standing
        how = "again"
        if welcome.restore == Restore.CHECKPOINT:
            how = f"again from the checkpoint of epoch {welcome.resume_epoch}"
        elif welcome.restore == Restore.PEERS:  # newcomers joined: rank 0's state, to everyone
            how = "with rank 0's state"
        WORKER.info(
            f"epochal: rank {moved.was} is rank {standing.rank} of {standing.world_size} in world "
            f"{standing.generation}: epoch {welcome.start_epoch} {how} "
            f"({time.monotonic() - moved.started:.2f} s to regroup)"
        )

    def _join(self, welcome: Welcome) -> None:
        """Join the new world's process group, keeping its connections to shut."""
        store = self._standing.store
        _, self._sockets = GroupSockets.opened_by(
            lambda: dist.init_process_group(
                backend=welcome.backend,
                store=scoped(store.store, welcome.run_id, store.key),
                rank=welcome.rank,
                world_size=welcome.world_size,
                timeout=timedelta(seconds=self._store_timeout),
                device_id=self._device if self._device.type == "cuda" else None,
            )
        )
