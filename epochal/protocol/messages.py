"""The control-plane messages: one class each, registered under its wire name where it is defined.

A message is a class decorated with :func:`message`, which makes it a frozen dataclass and
registers it under its wire name, the class name in snake case (``EpochReady`` travels as
``"epoch_ready"``). Its base class says who sends it: :class:`WorkerMessage`,
:class:`CoordinatorMessage`, or both. Everything else is derived from that registry: the codec's
decoders, :data:`MESSAGE_TYPES`, the names ``epochal.protocol`` exports, the message names a fault
filter accepts. A field's own constraint is declared on its type (``epoch: NonNeg``, that is
``Annotated[int, Ge(0)]``; ``code: Annotated[str, OneOf(RejectCode)]``; a list's bound,
``Annotated[tuple[Metric, ...], Items(MAX_METRICS)]``) and checked whenever a message is made,
by its sender as by the codec (raising ``ValueError``); a check between fields lives in the
class's ``_validate``. The codec in :mod:`epochal.protocol.codec` checks field types and turns
any failure into :class:`~epochal.errors.MalformedMessage`. ``docs/protocol.md`` describes the
exchange, and a test holds it to these classes.

Evolving them: a new field within a major version has a default (a frame from an older peer
leaves it out and stands for the default; an older peer skips it) and bumps
:data:`PROTOCOL_MINOR`; a new message type, a field without a default, a field removed or a
changed meaning bumps :data:`PROTOCOL_VERSION` (``tests/protocol/test_versions.py`` holds the
required fields of the major version).

The parts they are made of live by job: the version and every bound in
:mod:`~epochal.protocol.limits`, the closed sets of strings and the rules for names in
:mod:`~epochal.protocol.strings`, the constraints and field types in
:mod:`~epochal.protocol.constraints`, the registry in :mod:`~epochal.protocol.registry`, the
records messages are made of (a fingerprint, a metric) in :mod:`~epochal.protocol.records`; all
are re-exported here. This module's imports are private (underscored) or the parts' own names:
``from epochal.protocol.messages import *`` exports exactly the protocol's names.
"""

from typing import Annotated as _Annotated

# the parts, re-exported with the messages: ``from epochal.protocol import X`` finds them all
from epochal.protocol.constraints import *  # noqa: F403
from epochal.protocol.constraints import (
    Finite,
    Items,
    MaybeName,
    MaybePath,
    Name,
    NonNeg,
    OneOf,
    Port,
    Positive,
    Session,
    Text,
    Within,
)
from epochal.protocol.limits import *  # noqa: F403
from epochal.protocol.limits import (
    MAX_METRICS,
    MAX_OPTIONAL_TYPES,
    MAX_PAGE_PARAMS,
)
from epochal.protocol.records import *  # noqa: F403
from epochal.protocol.records import (
    Fingerprint,
    Liveness,
    Metric,
    MetricName,
    Metrics,
    ParamSpec,
    StepRates,
    TypeName,
)
from epochal.protocol.registry import *  # noqa: F403
from epochal.protocol.registry import CoordinatorMessage, WorkerMessage, message
from epochal.protocol.strings import *  # noqa: F403
from epochal.protocol.strings import (
    Awaiting,
    Backend,
    Device,
    Phase,
    RejectCode,
    Restore,
    SnapshotScope,
)

# ------------------------------------------------------------------------ shared parts


def _check_metrics(field: str, metrics: tuple[Metric, ...]) -> None:
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"{field} names a metric twice")


# ------------------------------------------------------------------------ worker -> coordinator


@message
class Hello(WorkerMessage):
    """A worker asks to join the run. Sent again, unchanged, while no answer comes."""

    job: Name
    # the job name; must equal the coordinator's
    token: MaybeName
    # shared secret; empty when the coordinator requires none
    worker_id: Name
    # unique per worker process; a second worker with the same id is a duplicate
    host: Name
    pid: NonNeg
    rank_hint: NonNeg | None
    # the rank this worker asks for (the launcher passes its index); None: any
    device: _Annotated[str, OneOf(Device)]
    # the coordinator picks the backend from every rank's device
    fingerprint: Fingerprint
    # the model's digest: the coordinator compares it with every other worker's
    data_address: MaybeName = ""
    # the address this worker's data plane uses (for the coordinator's log); "": not given
    metrics: _Annotated[tuple[_Annotated[str, MetricName()], ...], Items(MAX_METRICS)] | None = None
    # the names of the metrics the training code will report (epochal.train's metrics=), each a
    # metric name, so that a --monitor naming none of them stops the run before it trains;
    # None: not said
    run_id: MaybeName = ""
    # the run this worker is in, when it says hello again to a restarted coordinator (6.3): one
    # whose journal holds the run's last decision takes it back where it is (Welcome.carry_on);
    # "": a worker that is in no run yet
    understands: _Annotated[tuple[TypeName, ...], Items(MAX_OPTIONAL_TYPES)] = ()
    # the optional message types this worker understands (6.5): the coordinator sends it no other

    def _validate(self) -> None:
        for index, name in enumerate(self.metrics or ()):
            MetricName()(f"metrics[{index}]", name)


@message
class StoreReady(WorkerMessage):
    """Rank 0 has opened the data-plane store and reports where it listens."""

    host: Name
    port: Port
    key: MaybeName = ""
    generation: NonNeg = 0
    # the world whose store this is (OpenStore.generation)
    # the secret every data-plane store key lives under; sent on to each rank in Welcome


@message
class EpochReady(WorkerMessage):
    """A worker is ready for ``epoch`` and holds this many batches.

    Sent on its own before the first epoch of a run (or of a resume); for every later epoch it
    travels inside the previous epoch's :class:`EpochReport` (``ready``)."""

    epoch: NonNeg
    train_batches: NonNeg
    valid_batches: NonNeg | None
    # None: this worker has no validation loader at all
    generation: NonNeg = 0
    # the world this worker is in (Welcome.generation): one of an older world is dropped
    snapshots: _Annotated[str, OneOf(SnapshotScope)] = "whole"
    # what this rank's in-memory copy of the epoch's start holds (elastic runs): how a world
    # that loses ranks, or grows, restores
    gathers: bool = False
    # (6.4) this rank's training code gathers its part of the whole state onto rank 0 when a
    # decision asks (Decision.gather): a world of shards then grows over the data plane
    pass_batches: Positive | None = None
    # (6.6) runs with steps per epoch: the global batches of one pass over the training data
    # (this rank's loader's batches per pass), which every rank must agree on; None: not known
    # (a stream), or an epoch is one pass
    global_batch: Positive | None = None
    # (6.6) the samples of one global batch, every rank's together; None: not known


@message
class EpochReport(WorkerMessage):
    """A worker's loss sums for ``epoch``: per-sample loss summed, and the sample count."""

    epoch: NonNeg
    train_loss_sum: float
    train_count: NonNeg
    valid_loss_sum: float
    valid_count: NonNeg
    # 0 when the worker did not validate this epoch
    train_metrics: Metrics = ()
    # the training code's named metrics of the training split, as sums and counts
    valid_metrics: Metrics = ()
    # the same of the validation split (empty when the worker did not validate)
    ready: EpochReady | None = None
    # this worker's batch counts for epoch + 1, so that the Decision can carry its Go;
    # None: epoch + 1 is past the run's last epoch
    checksum: _Annotated[int, Within(0, 2**32 - 1)] | None = None
    # a 32-bit checksum of this rank's parameters after the epoch (worker/training/checksums.py),
    # where every rank holds the whole model
    # and Welcome.replica_check asks for it; None: not compared
    generation: NonNeg = 0
    # the world this worker is in (Welcome.generation): a report of an older world is dropped
    lr: _Annotated[float, Finite()] | None = None
    # the learning rate this rank's optimizer holds (its first parameter group's) when the epoch
    # is reported, where the training code says it (epochal.train does); None: not known

    def _validate(self) -> None:
        _check_metrics("train_metrics", self.train_metrics)
        _check_metrics("valid_metrics", self.valid_metrics)
        if self.ready is not None and self.ready.epoch != self.epoch + 1:
            raise ValueError(
                f"ready is for epoch {self.ready.epoch}, not the next one ({self.epoch + 1})"
            )


@message
class Checkpointed(WorkerMessage):
    """Rank 0 has committed the checkpoint of ``epoch`` (renamed into place, manifest written)."""

    epoch: NonNeg


@message
class Failed(WorkerMessage):
    """The worker hit an error it cannot recover from; the run must stop."""

    reason: Text


@message
class Broken(WorkerMessage):
    """A collective of ``epoch`` failed in world ``generation`` (a peer is probably gone); the
    worker has left its process group and waits for a new world (Regroup, Welcome) or Abort."""

    epoch: NonNeg
    generation: NonNeg
    reason: Text


@message
class Done(WorkerMessage):
    """The worker has restored the best weights and is leaving."""


@message
class Status(WorkerMessage):
    """A worker's heartbeat: where its training code is, so a stall can be located."""

    phase: Phase
    epoch: NonNeg
    step: NonNeg
    # batches done in this phase of this epoch
    where: MaybeName
    # the line the training code's thread is executing ("file.py:12 in fn"), for stall reports
    awaiting: Awaiting | None = None
    # phase waiting: the answer it waits for; any other phase: None

    def _validate(self) -> None:
        if (self.phase == Phase.WAITING) != (self.awaiting is not None):
            raise ValueError("awaiting is given exactly when the phase is waiting")


@message
class ModelPage(WorkerMessage):
    """Entries ``first`` .. ``first + len(params) - 1`` of this worker's model, answering
    :class:`DescribeModel`; :func:`epochal.protocol.paging.model_page` makes one that fits a
    frame. A name longer than MAX_NAME_CHARS is cut (the digest covers it whole)."""

    first: NonNeg
    # the index of params[0] in the model's list of parameters and buffers
    entries: NonNeg
    # how many entries the whole list has (the hello's fingerprint.entries)
    params: _Annotated[tuple[ParamSpec, ...], Items(MAX_PAGE_PARAMS)]

    def _validate(self) -> None:
        if self.first + len(self.params) > self.entries:
            raise ValueError(
                f"entries {self.first}..{self.first + len(self.params) - 1} are past the "
                f"{self.entries} the model has"
            )


@message
class Heartbeat(WorkerMessage, CoordinatorMessage):
    """Liveness, both ways; any message also counts as a heartbeat."""


# ------------------------------------------------------------------------ coordinator -> worker


@message
class OpenStore(CoordinatorMessage):
    """Sent to rank 0 only: open the data-plane store on port 0 and answer with StoreReady."""

    run_id: Name
    generation: NonNeg = 0
    # the world the store is for (0: the run's first); StoreReady says it back


@message
class Welcome(CoordinatorMessage):
    """The worker is in: its rank, the world, and where the data plane meets."""

    rank: int
    world_size: Positive
    run_id: Name
    backend: _Annotated[str, OneOf(Backend)]
    store_host: Name
    store_port: Port
    start_epoch: NonNeg
    epochs: Positive
    resume_epoch: NonNeg | None
    # load the checkpoint of this epoch before training; None: a fresh start
    checkpoint_dir: MaybePath
    # where checkpoints live (absolute; shared by all ranks); empty: checkpointing is off
    session: Session
    # this worker's session secret, as in its Joined (a Welcome may answer a retried hello)
    liveness: Liveness
    # the run's heartbeat interval and timeout, as in its Joined
    store_key: MaybeName = ""
    # the secret rank 0 put every data-plane store key under (StoreReady.key)
    replica_check: bool = True
    # report a checksum of the weights with every epoch (EpochReport.checksum)
    generation: NonNeg = 0
    # the world this welcome forms: 0 for the run's first, one more for each change
    restore: _Annotated[str, OneOf(Restore)] = "none"
    # where the state of start_epoch comes from in this world (see Restore)
    elastic: bool = False
    # the run goes on without a lost worker: keep an in-memory copy of each epoch's start
    carry_on: bool = False
    # (6.3) a restarted coordinator takes back a worker of the run its journal holds, where the
    # worker is: it keeps its process group and store (the store fields are not used), adopts the
    # session and sends again the message it awaits an answer to (and rank 0 its last
    # checkpointed); the coordinator answers from its journal, and no epoch is redone
    understands: _Annotated[tuple[TypeName, ...], Items(MAX_OPTIONAL_TYPES)] = ()
    # the optional message types the coordinator understands (6.5): the worker sends it no other
    steps_per_epoch: Positive | None = None
    # (6.6) an epoch is this many global optimizer steps, the data going on across epochs;
    # None: an epoch is one pass over the data
    lr_steps: StepRates | None = None
    # (6.7) set the learning-rate factor at every optimizer step from the run's global step;
    # None: the factor of each go holds for its whole epoch

    def _validate(self) -> None:
        if self.resume_epoch is not None and self.checkpoint_dir == "":
            raise ValueError("resume_epoch needs a checkpoint_dir")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside 0..{self.world_size - 1}")


@message
class Joined(CoordinatorMessage):
    """The hello was accepted; the worker waits for the rest (sent again for a retried hello)."""

    joined: int
    world_size: Positive
    session: Session
    # a secret for this worker alone: every frame it sends from now on must carry it (key "s")
    liveness: Liveness
    # the run's heartbeat interval and timeout: the worker adopts them

    def _validate(self) -> None:
        if not 0 < self.joined <= self.world_size:
            raise ValueError(f"joined {self.joined} outside 1..{self.world_size}")


@message
class Reject(CoordinatorMessage):
    """This worker may not join, or the coordinator does not know it; the run goes on."""

    reason: Text
    code: _Annotated[str, OneOf(RejectCode)]


@message
class Go(CoordinatorMessage):
    """Run ``epoch`` with exactly these batch counts at this learning-rate factor.

    Sent on its own to answer every rank's :class:`EpochReady`; for every later epoch it travels
    inside the previous epoch's :class:`Decision` (``go``)."""

    epoch: NonNeg
    train_batches: Positive
    valid_batches: NonNeg
    # 0: no validation this epoch
    lr_factor: _Annotated[float, Finite()]


@message
class Decision(CoordinatorMessage):
    """The coordinator's verdict on ``epoch``, identical for every rank."""

    epoch: NonNeg
    train_loss: float
    valid_loss: float | None
    # None: nobody validated this epoch
    smoothed_loss: float | None
    best_epoch: NonNeg | None
    is_best: bool
    # this epoch is the new best: keep its weights
    checkpoint: bool
    # write a checkpoint of the state after this epoch
    stop: bool
    # no further epoch; a Finish follows
    train_metrics: Metrics = ()
    # every named metric summed over all ranks, with the total sample count
    valid_metrics: Metrics = ()
    go: Go | None = None
    # the Go of epoch + 1, planned from the batch counts the reports carried; None exactly when
    # the decision stops the run or gathers
    gather: bool = False
    # (6.4) newcomers join at this boundary and each rank holds a shard of the state: every rank
    # gathers its part of the whole state onto rank 0 now, in the group it is in, then announces
    # epoch + 1 with an epoch_ready; the world grows from there and rank 0 sends the state
    # gathered (every rank's readies say it can: EpochReady.gathers)

    def _validate(self) -> None:
        _check_metrics("train_metrics", self.train_metrics)
        _check_metrics("valid_metrics", self.valid_metrics)
        if self.gather and self.stop:
            raise ValueError("a decision that stops the run gathers nothing")
        if (self.go is None) != (self.stop or self.gather):
            raise ValueError(
                "go is given exactly when the decision neither stops the run nor gathers"
            )
        if self.go is not None and self.go.epoch != self.epoch + 1:
            raise ValueError(
                f"go is for epoch {self.go.epoch}, not the next one ({self.epoch + 1})"
            )


@message
class Finish(CoordinatorMessage):
    """The run is over: restore the weights of ``best_epoch``, send Done, leave."""

    best_epoch: NonNeg | None
    best_loss: float | None
    epochs_run: NonNeg
    restore_best: bool
    # load the best epoch's weights (else keep the last epoch's)


@message
class Regroup(CoordinatorMessage):
    """The world changes before ``epoch`` is (re)done: leave the process group now, between two
    batches, and wait for the Welcome of world ``generation`` (rank 0 of it: first OpenStore)."""

    generation: Positive
    epoch: NonNeg


@message
class Abort(CoordinatorMessage):
    """The run is stopped for every rank; ``reason`` says which rank, what and what to do."""

    reason: Text


@message
class DescribeModel(CoordinatorMessage):
    """Send one :class:`ModelPage` of your model's entries, from entry ``first`` on.

    Asked only of workers whose hello showed the job's token: the two whose fingerprints differ,
    to name the first difference, or one member, to record the run's model in its run directory.
    A worker answers from its control thread, whatever its training code is doing."""

    first: NonNeg
