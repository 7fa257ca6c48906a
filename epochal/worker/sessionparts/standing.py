"""What a worker's session knows of its run: this rank's place in the world, how the world
started and where its checkpoints go.

One :class:`Standing` is shared by the session's parts (:mod:`epochal.worker.sessionparts`): a
welcome — the first, a restarted coordinator's, a new world's — changes it through
:meth:`Standing.adopt`, so that every part reads the same rank, generation and checkpointer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epochal.protocol import StepRates, Welcome
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.control.admission import StoreRef


@dataclass(kw_only=True, slots=True)
class Standing:
    """This rank's standing in the run, as the last welcome said it."""

    rank: int
    world_size: int
    backend: str
    # the process group's backend, chosen once by the coordinator for the whole run
    store: StoreRef
    # the data-plane store the process group meets at (rank 0 hosts it: it must live as long as
    # the process group); a new world may meet at another
    run_id: str
    generation: int
    # the world's number: one more with each change of world; older messages are refused
    restore: str
    # how this world's members take the state of start_epoch (Restore): "peers" means newcomers
    # joined, and every rank takes rank 0's state over the data plane
    elastic: bool
    # the run goes on without a lost rank: each epoch's start is kept (Rejoin)
    start_epoch: int
    epochs: int
    resume_epoch: int | None
    # the epoch whose checkpoint the run resumes from; None: it starts afresh
    replica_check: bool
    # every rank reports its weights' checksum after each epoch
    checkpointer: Checkpointer | None
    # this rank's checkpoints of the run; None: the run keeps none
    steps_per_epoch: int | None = None
    # an epoch is this many global optimizer steps; None: one pass over the data
    lr_steps: StepRates | None = None
    # the learning-rate factor set at every optimizer step; None: each go's factor holds

    @classmethod
    def welcomed(cls, welcome: Welcome, store: StoreRef) -> Standing:
        """The standing the first welcome gives, with the store the process group met at."""
        return cls(
            rank=welcome.rank,
            world_size=welcome.world_size,
            backend=welcome.backend,
            store=store,
            run_id=welcome.run_id,
            generation=welcome.generation,
            restore=welcome.restore,
            elastic=welcome.elastic,
            start_epoch=welcome.start_epoch,
            epochs=welcome.epochs,
            resume_epoch=welcome.resume_epoch,
            replica_check=welcome.replica_check,
            checkpointer=_checkpointer(welcome),
            steps_per_epoch=welcome.steps_per_epoch,
            lr_steps=welcome.lr_steps,
        )

    def adopt(self, welcome: Welcome) -> None:
        """Take what a later welcome says: a restarted coordinator's, or a new world's (whose
        rank and size may differ). The backend stays: a run never changes it."""
        self.rank, self.world_size = welcome.rank, welcome.world_size
        self.run_id = welcome.run_id
        self.generation = welcome.generation
        self.restore = welcome.restore
        self.elastic = welcome.elastic
        self.start_epoch = welcome.start_epoch
        self.epochs = welcome.epochs
        self.resume_epoch = welcome.resume_epoch
        self.replica_check = welcome.replica_check
        self.checkpointer = _checkpointer(welcome)
        self.steps_per_epoch = welcome.steps_per_epoch
        self.lr_steps = welcome.lr_steps


def _checkpointer(welcome: Welcome) -> Checkpointer | None:
    """The checkpoints of ``welcome``'s run as its rank writes and reads them, if it keeps any."""
    if not welcome.checkpoint_dir:
        return None
    return Checkpointer(Path(welcome.checkpoint_dir), rank=welcome.rank, run_id=welcome.run_id)
