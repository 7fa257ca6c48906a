"""A survivor's way from a broken world into the next: leave the process group, meet the new one.

When the coordinator decides a new world (a rank was lost and at least ``--min-workers`` remain),
every survivor hears ``regroup``. The session then has its training code drop every reference to
the old process group (:class:`Rejoin.leave`: DDP wrappers, optimizers over it), destroys the group
so that its sockets close (:func:`leave_group`: a peer still blocked in a collective with this rank
raises at once, and leaves too), and :func:`meet` answers the coordinator until the new world's
``welcome``: the new rank 0 keeps serving its store under a new key (or, when the old rank 0 was
lost, starts a store of its own) and says ``store_ready``; the others connect to the store the
welcome names. The session then joins the new process group and has its training code build over
it and restore the epoch's start (:class:`Rejoin.rebuild`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from epochal.protocol import OpenStore, Regroup, SnapshotScope, StoreReady, Welcome
from epochal.worker.control.admission import StoreRef
from epochal.worker.control.client import ControlClient
from epochal.worker.dataplane.sockets import restore_excepthook
from epochal.worker.dataplane.store import StoreServer, connect_store, new_key
from epochal.worker.joinoptions import advertised_host


@dataclass(frozen=True, slots=True)
class Rejoin:
    """What a training loop does around a change of world (``Session.run_epochs(rejoin=)``)."""

    leave: Callable[[BaseException | None], None]
    # given the error that broke the epoch (or the instruction to leave): release everything
    # built over the old process group (wrappers, the error's frames) and destroy the group
    rebuild: Callable[[int], Any]
    # the new group is up: build over it again and restore the start of the given epoch from
    # this rank's copy (unless the world restores a checkpoint: Session.restore "checkpoint",
    # which the session then loads into the returned state); returns the state a checkpoint
    # holds from now on (or None)
    scope: SnapshotScope = SnapshotScope.WHOLE
    # what this rank's copy of an epoch's start holds: the coordinator restores a world from
    # the copies where they hold the whole state, else from the last checkpoint
    gather: Callable[[int], None] | None = None
    # collective, in the group the rank is in, at an epoch boundary (Decision.gather): keep this
    # rank's part of the state the given epoch starts from, gathered onto rank 0, which sends it
    # to every rank of the world that grows next (rebuild, restore "peers"). None: a world whose
    # copies are not whole grows from the boundary's checkpoint instead


def leave_group() -> None:
    """Destroy the process group, if the training loop's ``leave`` did not, once nothing else
    holds it, so that its sockets close. (One that did, as ``epochal.train``'s does through
    :func:`epochal.worker.regroup.leave`, collected its garbage already: a full collection costs
    0.2 s or more with torch loaded, so none is repeated here.)"""
    if not dist.is_initialized():
        return
    gc.collect()  # wrappers dropped by the training code, and the frames of a caught error
    restore_excepthook()  # the group's rank prefix would be the old world's
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group may fail to tear down; its sockets close with it
        pass
    gc.collect()


def meet(
    client: ControlClient,
    regroup: Regroup,
    store: StoreRef,
    *,
    endpoint: str,
    timeout: float,
) -> tuple[Welcome, StoreRef]:
    """Answer the coordinator until the welcome of ``regroup``'s world (or of a later one, when
    the world changed again meanwhile); returns it and the store the new group meets at."""
    generation = regroup.generation
    while True:
        message = client.receive()
        match message:
            case Regroup() if message.generation > generation:
                client.take_regroup(message)
                generation = message.generation
            case OpenStore() if message.generation == generation:
                if store.server is None:  # the store's host was lost: this rank hosts one now
                    host = advertised_host(endpoint)
                    server = StoreServer.start(host, timeout)
                    store = StoreRef(server.connect(timeout), host, server.port, new_key(), server)
                else:  # the same server; the new world's keys under a key of their own
                    store = replace(store, key=new_key())
                client.send(
                    StoreReady(
                        host=store.host, port=store.port, key=store.key, generation=generation
                    )
                )
            case Welcome() if message.generation == generation:
                here = (store.host, store.port) == (message.store_host, message.store_port)
                if here and store.server is not None:
                    store.server.expect(message.world_size)
                    return message, store
                if store.server is not None:  # no longer rank 0 (cannot happen: order is kept)
                    store.server.close()
                found = connect_store(message.store_host, message.store_port, timeout)
                return message, StoreRef(
                    found, message.store_host, message.store_port, message.store_key
                )
            case _:
                continue  # what the world that is gone still said (a decision, a go)
