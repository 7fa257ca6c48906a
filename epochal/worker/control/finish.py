"""A rank that ran no epochs of epochal's says it is done and waits for the run's finish.

Used by a session that :func:`~epochal.worker.join.join` opened for the rendezvous and the process
group only (the script keeps its own loop), and by ``epochal worker --torchrun``, which joins for a
script that makes its own process group (:mod:`epochal.worker.plain`). The run is finished once
every rank has said so.
"""

from __future__ import annotations

import time

from epochal.errors import CoordinatorLost
from epochal.log import WORKER
from epochal.protocol import Done, Finish, Phase
from epochal.worker.control.client import ControlClient


def finish_without_epochs(
    client: ControlClient, rank: int, epoch: int, finish: Finish | None = None
) -> None:
    """Send ``done`` and wait, at most the run's heartbeat timeout, for the run's ``finish``
    (``finish``: it came already). RunAborted when the run was aborted meanwhile (another rank
    failed)."""
    client.at(Phase.FINISHING, epoch)
    client.send(Done())
    if finish is not None:
        return
    end = time.monotonic() + client.liveness.timeout
    try:
        while (left := end - time.monotonic()) > 0:
            if isinstance(client.receive(timeout=left), Finish):
                return
    except (TimeoutError, CoordinatorLost) as exc:
        WORKER.info(
            f"epochal: rank {rank}: closed its session without the run's finish ({exc}); the "
            "coordinator ends the run at its --finish-timeout"
        )
