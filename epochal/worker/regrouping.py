"""A session that goes on in a new world when a rank is lost (an elastic run): it tells the
coordinator of a broken epoch, leaves the old process group (shutting its connections, so that a
collective blocked on a frozen peer raises at once), meets the next world and rebuilds over it.

:class:`Regrouping` is the part of :class:`~epochal.worker.session.Session` that does it; the
session sets every attribute below in its ``__init__``. docs/elastic.md tells the whole story.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from epochal.errors import EpochalError
from epochal.log import WORKER
from epochal.protocol import Broken, Phase, Regroup, Restore, Welcome, clip
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.checkpoints.state import Stateful
from epochal.worker.control.client import ControlClient
from epochal.worker.control.exits import failure_reason
from epochal.worker.control.rendezvous import StoreRef
from epochal.worker.control.worlds import Rejoin, leave_group, meet
from epochal.worker.dataplane.sockets import GroupSockets
from epochal.worker.dataplane.store import scoped


class Regrouping:
    """Following a world change; see the module docstring."""

    client: ControlClient
    rank: int
    world_size: int
    generation: int
    device: torch.device
    _sockets: GroupSockets
    _store: StoreRef
    _endpoint: str
    _store_timeout: float
    checkpointer: Checkpointer | None

    def _adopt(self, welcome: Welcome) -> None:
        raise NotImplementedError  # the session's

    def _broken(self, epoch: int, exc: Exception) -> Regroup:
        """The epoch failed (a collective, most likely, whose peer is gone): tell the
        coordinator, and wait for the new world it decides (or its abort, raised)."""
        reason = failure_reason(exc)
        self._sockets.shut()  # peers blocked in a collective with this rank raise too
        self.client.send(Broken(epoch=epoch, generation=self.generation, reason=clip(reason)))
        WORKER.info(
            f"epochal: rank {self.rank}: epoch {epoch} broke ({reason}); waiting for the "
            "coordinator to form a new world"
        )
        while True:
            message = self.client.receive()
            if isinstance(message, Regroup) and message.generation > self.generation:
                return message

    def _leave_now(self, regroup: Regroup) -> None:
        """In the control client's thread, as a new world is decided: shut this group's
        connections, so that a collective this rank is blocked in raises now (its peer may be
        frozen or cut off, and gloo has no abort); the main thread then follows the Regroup."""
        if regroup.generation > self.generation:
            self._sockets.shut()

    def _regroup(
        self, regroup: Regroup, rejoin: Rejoin | None, error: BaseException | None
    ) -> tuple[int, Stateful | None]:
        """Leave the broken world (``error``: what broke the epoch, whose frames may hold the
        old group), meet the next, rebuild over it: the epoch to redo, and the state a
        checkpoint holds from now on (None: the same)."""
        self.client.take_regroup(regroup)
        if rejoin is None:
            raise EpochalError(
                "a rank was lost and the run goes on without it, but this training loop cannot: "
                "pass rejoin= to Session.run_epochs (epochal.train does), or run without "
                "--min-workers"
            )
        started = time.monotonic()
        was = self.rank
        self.client.at(Phase.CONNECT, regroup.epoch)
        self._sockets.shut()
        rejoin.leave(error)
        leave_group()
        welcome, self._store = meet(
            self.client, regroup, self._store, endpoint=self._endpoint, timeout=self._store_timeout
        )
        self.rank, self.world_size = welcome.rank, welcome.world_size
        self.client.rank = self.rank
        self._adopt(welcome)
        store = self._store
        _, self._sockets = GroupSockets.opened_by(
            lambda: dist.init_process_group(
                backend=welcome.backend,
                store=scoped(store.store, welcome.run_id, store.key),
                rank=welcome.rank,
                world_size=welcome.world_size,
                timeout=timedelta(seconds=self._store_timeout),
                device_id=self.device if self.device.type == "cuda" else None,
            )
        )
        self.client.at(Phase.SETUP, welcome.start_epoch)
        state = rejoin.rebuild(welcome.start_epoch)
        how = "again"
        if welcome.restore == Restore.CHECKPOINT:
            assert welcome.resume_epoch is not None  # the coordinator's rule (Welcome)
            self._load_for_world(welcome.resume_epoch, state)
            how = f"again from the checkpoint of epoch {welcome.resume_epoch}"
        elif welcome.restore == Restore.PEERS:  # newcomers joined: rank 0's state, to everyone
            how = "with rank 0's state"
        WORKER.info(
            f"epochal: rank {was} is rank {self.rank} of {self.world_size} in world "
            f"{self.generation}: epoch {welcome.start_epoch} {how} "
            f"({time.monotonic() - started:.2f} s to regroup)"
        )
        return welcome.start_epoch, state

    def _load_for_world(self, epoch: int, state: Stateful | None) -> None:
        """Collective: every member of the new world loads the checkpoint of ``epoch``, which DCP
        reshards to the new size, and this rank's generators where the checkpoint has them."""
        checkpointer = self.checkpointer
        if state is None or checkpointer is None:
            raise EpochalError(
                f"the new world restores the checkpoint of epoch {epoch}, but this training loop "
                "returned no state to load it into from its rebuild (or the run has no "
                "checkpoint directory)"
            )
        checkpointer.load(epoch, state, rng=None)
