"""The control-plane messages: one class each, registered under its wire name where it is defined.

A message is a class decorated with :func:`message`, which makes it a frozen dataclass and
registers it under its wire name, the class name in snake case (``EpochReady`` travels as
``"epoch_ready"``). Its base class says who sends it: :class:`WorkerMessage`,
:class:`CoordinatorMessage`, or both. Everything else is derived from that registry: the codec's
decoders, :data:`MESSAGE_TYPES`, the names ``epochal.protocol`` exports, the message names a fault
filter accepts. A field's own constraint is declared on its type (``epoch: NonNeg``, that is
``Annotated[int, Ge(0)]``; ``code: Annotated[str, OneOf(RejectCode)]``) and checked whenever a
message is made, by its sender as by the codec (raising ``ValueError``); a check between fields
lives in the class's ``_validate``. The codec in :mod:`epochal.protocol.codec` checks field types
and turns any failure into :class:`~epochal.errors.MalformedMessage`. ``docs/protocol.md``
describes the exchange, and a test holds it to these classes.

This module's imports are private (underscored): ``from epochal.protocol.messages import *``
exports exactly the protocol's names.
"""

import dataclasses as _dataclasses
import enum as _enum
import math as _math
import re as _re
import types as _types
import typing as _typing
from collections.abc import Callable as _Callable
from typing import Annotated as _Annotated
from typing import Any as _Any

PROTOCOL_VERSION = 3
"""Bumped on any change to a message's fields or meaning; peers of other versions are refused."""

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest frame either side accepts (a hello with a large model's fingerprint fits easily)."""

MAX_TEXT_CHARS = 64 * 1024
"""Longest string field (reasons, names); longer reasons are cut by :func:`clip`."""

MAX_PARAMS = 100_000
"""Most parameter entries one fingerprint may list."""

MAX_SESSION_CHARS = 64
"""Longest session secret a Joined or Welcome may carry (the coordinator issues 43 characters)."""

MAX_SHAPE_DIMS = 64
"""Most dimensions one parameter's shape may have."""

MAX_METRICS = 64
"""Most named metrics one split of an epoch may report (besides the loss)."""

MAX_METRIC_NAME_CHARS = 64
"""Longest metric name."""

RESERVED_METRIC_NAMES = frozenset({"loss", "batches"})
"""Names a metric may not take: the journal already has ``train_loss``, ``valid_batches``..."""

_METRIC_NAME = _re.compile(rf"^[A-Za-z][A-Za-z0-9_]{{0,{MAX_METRIC_NAME_CHARS - 1}}}$")


def check_metric_name(name: str) -> str:
    """Return ``name`` if it may name a metric, else raise ValueError saying what is allowed.

    A metric name is 1-64 letters, digits or ``_``, starting with a letter, and not ``loss``
    or ``batches`` (the loss is reported on its own): it becomes part of journal keys
    (``valid_accuracy``) and of ``--monitor``.
    """
    if not isinstance(name, str) or not _METRIC_NAME.fullmatch(name):
        raise ValueError(
            f"metric name {name!r} is not allowed: use 1-{MAX_METRIC_NAME_CHARS} letters, digits "
            "or '_', starting with a letter"
        )
    if name in RESERVED_METRIC_NAMES:
        raise ValueError(f"{name!r} is reported on its own and cannot name a metric")
    return name


DEFAULT_JOB = "epochal"
"""Job name of a coordinator or worker that was given none."""

_JOB_NAME = _re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_job_name(job: str) -> str:
    """Return ``job`` if it is a valid job name, else raise ValueError saying what is allowed."""
    if not _JOB_NAME.fullmatch(job):
        raise ValueError(
            f"job name {job!r} is not allowed: use 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return job


def clip(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """Cut ``text`` to what a string field may hold, marking the cut."""
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"


# ------------------------------------------------------------------------ closed sets of strings


class Phase(_enum.StrEnum):
    """Where a worker's training code is; sent with every heartbeat (:class:`Status`).

    A ``str`` on the wire; the codec refuses any other value, so a misspelt phase fails where it is
    made, not as a silence the coordinator later blames on the worker.
    """

    RENDEZVOUS = "rendezvous"
    # saying hello and waiting for the other workers
    CONNECT = "connect"
    # opening or joining the data-plane store and initialising the process group
    SETUP = "setup"
    # in the process group, preparing to train (wrapping the model, loading a checkpoint)
    WAITING = "waiting"
    # waiting for the coordinator's answer (Go, Decision, Finish)
    TRAIN = "train"
    VALIDATE = "validate"
    CHECKPOINT = "checkpoint"
    FINISHING = "finishing"

    @property
    def description(self) -> str:
        """The phase in words, for messages: "connecting the data plane"."""
        return _PHASE_WORDS[self]


_PHASE_WORDS = {
    Phase.RENDEZVOUS: "joining the run",
    Phase.CONNECT: "connecting the data plane",
    Phase.SETUP: "setting up before the first epoch",
    Phase.WAITING: "waiting for the coordinator",
    Phase.TRAIN: "training",
    Phase.VALIDATE: "validating",
    Phase.CHECKPOINT: "writing a checkpoint",
    Phase.FINISHING: "finishing",
}

PHASES = tuple(p.value for p in Phase)


class RejectCode(_enum.StrEnum):
    """Why a :class:`Reject` was sent."""

    REFUSED = "refused"
    # the hello was judged and refused
    NOT_MEMBER = "not_member"
    # a message other than hello from a peer the coordinator does not know (e.g. after a restart)
    MALFORMED = "malformed"
    # the frame could not be read
    VERSION = "version"
    # the frame is of another protocol version


class Backend(_enum.StrEnum):
    """The torch.distributed backend every rank initialises (:class:`Welcome`)."""

    GLOO = "gloo"
    NCCL = "nccl"


class Device(_enum.StrEnum):
    """The kind of device a worker trains on (:class:`Hello`)."""

    CPU = "cpu"
    CUDA = "cuda"


def _one_of(choices: type[_enum.StrEnum], name: str, value: object) -> _enum.StrEnum:
    if isinstance(value, choices):
        return value
    if isinstance(value, str):
        member = choices._value2member_map_.get(value)
        if member is not None:
            return _typing.cast(_enum.StrEnum, member)
    allowed = ", ".join(member.value for member in choices)
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def check_phase(phase: object) -> Phase:
    """``phase`` as a :class:`Phase`, or ValueError naming the phases there are."""
    return _typing.cast(Phase, _one_of(Phase, "phase", phase))


# ------------------------------------------------------------------------ constraints on types


@_dataclasses.dataclass(frozen=True, slots=True)
class Ge:
    """The value is at least ``least``."""

    least: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not value >= self.least:
            raise ValueError(f"{name} must be >= {self.least}, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Within:
    """The value lies in ``lowest..highest``."""

    lowest: int
    highest: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not self.lowest <= value <= self.highest:
            raise ValueError(f"{name} must be in {self.lowest}..{self.highest}, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Finite:
    """The float is neither infinite nor NaN."""

    def __call__(self, name: str, value: _Any) -> _Any:
        if not _math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Chars:
    """The string is at most ``most`` characters, and not empty unless ``empty``."""

    empty: bool = False
    most: int = MAX_TEXT_CHARS

    def __call__(self, name: str, value: _Any) -> _Any:
        if len(value) > self.most:
            raise ValueError(f"{name} is longer than {self.most} characters")
        if not self.empty and value == "":
            raise ValueError(f"{name} must not be empty")
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class Length:
    """The string has ``least``..``most`` characters (sessions)."""

    least: int
    most: int

    def __call__(self, name: str, value: _Any) -> _Any:
        if not self.least <= len(value) <= self.most:
            raise ValueError(
                f"{name} must be {self.least}-{self.most} characters, got {len(value)}"
            )
        return value


@_dataclasses.dataclass(frozen=True, slots=True)
class OneOf:
    """The string is a value of ``choices``; the field then holds the enum member."""

    choices: type[_enum.StrEnum]

    def __call__(self, name: str, value: _Any) -> _Any:
        return _one_of(self.choices, name, value)


NonNeg = _Annotated[int, Ge(0)]
"""An int >= 0 (epochs, counts, pids)."""
Positive = _Annotated[int, Ge(1)]
"""An int >= 1 (world sizes, epoch counts)."""
Port = _Annotated[int, Within(1, 65535)]
"""A TCP port number."""
Text = _Annotated[str, Chars()]
"""A non-empty string of at most MAX_TEXT_CHARS characters."""
MaybeText = _Annotated[str, Chars(empty=True)]
"""A string of at most MAX_TEXT_CHARS characters, possibly empty."""
Session = _Annotated[str, Length(1, MAX_SESSION_CHARS)]
"""A worker's session secret."""

Constraint = _Callable[[str, _Any], _Any]
"""A check declared on a field's type: called with the field's name and value, it returns the value
(an enum member for a string, see :class:`OneOf`) or raises ValueError saying what is wrong."""


@_dataclasses.dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a record as its declared type describes it; the codec compiles these."""

    name: str
    kind: type
    # int, float, bool, str, a StrEnum, tuple (then ``item``) or a Record
    nilable: bool
    # None is a value of this field
    constraints: tuple[Constraint, ...]
    item: "FieldSpec | None" = None
    # the type of a tuple's items


def _spec(name: str, tp: _Any) -> FieldSpec:
    nilable = False
    if _typing.get_origin(tp) in (_typing.Union, _types.UnionType):
        options = [o for o in _typing.get_args(tp) if o is not type(None)]
        if len(options) != 1:  # pragma: no cover - a message declared a union of types
            raise TypeError(f"{name}: only X | None unions are supported, got {tp!r}")
        nilable, tp = True, options[0]
    constraints: list[Constraint] = []
    if _typing.get_origin(tp) is _Annotated:
        tp, *metadata = _typing.get_args(tp)
        constraints.extend(metadata)
    if isinstance(tp, type) and issubclass(tp, _enum.StrEnum):
        constraints.insert(0, OneOf(tp))
        return FieldSpec(name, tp, nilable, tuple(constraints))
    if _typing.get_origin(tp) is tuple:
        item = _spec(name, _typing.get_args(tp)[0])
        return FieldSpec(name, tuple, nilable, tuple(constraints), item)
    if tp in (int, float, bool, str) or (isinstance(tp, type) and issubclass(tp, Record)):
        return FieldSpec(name, tp, nilable, tuple(constraints))
    raise TypeError(f"{name}: a message field cannot be of type {tp!r}")  # pragma: no cover


_FIELDS: dict[type, tuple[FieldSpec, ...]] = {}


def fields_of(cls: type) -> tuple[FieldSpec, ...]:
    """The declared fields of a record (message or part), in order."""
    found = _FIELDS.get(cls)
    if found is None:
        hints = _typing.get_type_hints(cls, include_extras=True)
        fields = _dataclasses.fields(cls)
        found = _FIELDS[cls] = tuple(_spec(f.name, hints[f.name]) for f in fields)
    return found


_Checks = tuple[tuple[str, bool, tuple[Constraint, ...]], ...]
_CHECKS: dict[type, _Checks] = {}


def _checks(cls: type) -> _Checks:
    """The constrained fields of ``cls``: name, whether None is allowed, the constraints."""
    found = _CHECKS.get(cls)
    if found is None:
        found = _CHECKS[cls] = tuple(
            (spec.name, spec.nilable, spec.constraints)
            for spec in fields_of(cls)
            if spec.constraints
        )
    return found


class Record:
    """A frozen dataclass whose fields' constraints are declared on their types."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for name, nilable, constraints in _checks(type(self)):
            value = original = getattr(self, name)
            if value is None and nilable:
                continue
            for constraint in constraints:
                value = constraint(name, value)
            if value is not original:  # a string become its enum member
                object.__setattr__(self, name, value)
        self._validate()

    def _validate(self) -> None:
        """Checks between fields; raises ValueError. Each field's own check is on its type."""


class Message(Record):
    """Any control message."""

    __slots__ = ()


class WorkerMessage(Message):
    """A message a worker sends to the coordinator."""

    __slots__ = ()


class CoordinatorMessage(Message):
    """A message the coordinator sends to a worker."""

    __slots__ = ()


MESSAGE_TYPES: dict[str, type[Message]] = {}
"""Wire name of every message type, filled by :func:`message`; the codec refuses any other."""

TYPE_NAMES: dict[type, str] = {}
"""Each message class's wire name."""

_M = _typing.TypeVar("_M", bound=Message)


def wire_name(class_name: str) -> str:
    """The wire name of a message class: its name in snake case (``OpenStore``: ``open_store``)."""
    return _re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", class_name).lower()


@_typing.dataclass_transform(frozen_default=True)
def message(cls: type[_M]) -> type[_M]:
    """Make ``cls`` a frozen dataclass and register it as the message named after it."""
    if not issubclass(cls, WorkerMessage | CoordinatorMessage):
        raise TypeError(f"{cls.__name__} must derive from WorkerMessage or CoordinatorMessage")
    made = _dataclasses.dataclass(frozen=True, slots=True)(cls)
    fields_of(made)  # a field of a type the codec cannot carry fails here, where it is declared
    name = wire_name(cls.__name__)
    if name in MESSAGE_TYPES:
        raise TypeError(f"two messages are named {name!r}")
    MESSAGE_TYPES[name] = made
    TYPE_NAMES[made] = name
    return made


def names_sent_by(sender: type[Message]) -> tuple[str, ...]:
    """Wire names of the messages ``sender`` (WorkerMessage or CoordinatorMessage) may send."""
    return tuple(name for name, cls in MESSAGE_TYPES.items() if issubclass(cls, sender))


# ------------------------------------------------------------------------ shared parts


@_dataclasses.dataclass(frozen=True, slots=True)
class ParamSpec(Record):
    """One named parameter or buffer of a model: its shape and dtype."""

    name: Text
    shape: tuple[int, ...]
    dtype: Text

    def _validate(self) -> None:
        if len(self.shape) > MAX_SHAPE_DIMS:
            raise ValueError(f"shape of {self.name} has more than {MAX_SHAPE_DIMS} dimensions")
        if not all(d >= 0 for d in self.shape):
            raise ValueError(f"shape of {self.name} has a negative size")


@_dataclasses.dataclass(frozen=True, slots=True)
class MetricName:
    """The string is a metric name (:func:`check_metric_name`)."""

    def __call__(self, name: str, value: _Any) -> _Any:
        try:
            return check_metric_name(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


@_dataclasses.dataclass(frozen=True, slots=True)
class Metric(Record):
    """One named metric of one split of an epoch: a sum over samples and the sample count.

    Its value is ``total / count``; sums and counts, not means, travel so that the coordinator
    weights every rank by its samples. ``total`` may be any float: a non-finite one aborts the run
    naming the rank, as a non-finite loss does.
    """

    name: _Annotated[str, MetricName()]
    total: float
    count: NonNeg


def _check_metrics(field: str, metrics: tuple[Metric, ...]) -> None:
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"{field} holds over {MAX_METRICS} metrics")
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError(f"{field} names a metric twice")


@_dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint(Record):
    """What must be identical on every rank: the model's parameters and the torch version."""

    digest: Text
    # sha256 of the entries below, so equal fingerprints compare in O(1)
    params: tuple[ParamSpec, ...]
    torch_version: Text

    def _validate(self) -> None:
        if len(self.params) > MAX_PARAMS:
            raise ValueError(f"fingerprint lists over {MAX_PARAMS} parameters")


# ------------------------------------------------------------------------ worker -> coordinator


@message
class Hello(WorkerMessage):
    """A worker asks to join the run. Sent again, unchanged, while no answer comes."""

    job: Text
    # the job name; must equal the coordinator's
    token: MaybeText
    # shared secret; empty when the coordinator requires none
    worker_id: Text
    # unique per worker process; a second worker with the same id is a duplicate
    host: Text
    pid: NonNeg
    rank_hint: NonNeg | None
    # the rank this worker asks for (the launcher passes its index); None: any
    device: _Annotated[str, OneOf(Device)]
    # the coordinator picks the backend from every rank's device
    fingerprint: Fingerprint
    data_address: MaybeText = ""
    # the address this worker's data plane uses (for the coordinator's log); "": not given


@message
class StoreReady(WorkerMessage):
    """Rank 0 has opened the data-plane store and reports where it listens."""

    host: Text
    port: Port
    key: MaybeText = ""
    # the secret every data-plane store key lives under; sent on to each rank in Welcome


@message
class EpochReady(WorkerMessage):
    """A worker is ready for ``epoch`` and holds this many batches."""

    epoch: NonNeg
    train_batches: NonNeg
    valid_batches: NonNeg | None
    # None: this worker has no validation loader at all


@message
class EpochReport(WorkerMessage):
    """A worker's loss sums for ``epoch``: per-sample loss summed, and the sample count."""

    epoch: NonNeg
    train_loss_sum: float
    train_count: NonNeg
    valid_loss_sum: float
    valid_count: NonNeg
    # 0 when the worker did not validate this epoch
    train_metrics: tuple[Metric, ...] = ()
    # the training code's named metrics of the training split, as sums and counts
    valid_metrics: tuple[Metric, ...] = ()
    # the same of the validation split (empty when the worker did not validate)

    def _validate(self) -> None:
        _check_metrics("train_metrics", self.train_metrics)
        _check_metrics("valid_metrics", self.valid_metrics)


@message
class Checkpointed(WorkerMessage):
    """Rank 0 has committed the checkpoint of ``epoch`` (renamed into place, manifest written)."""

    epoch: NonNeg


@message
class Failed(WorkerMessage):
    """The worker hit an error it cannot recover from; the run must stop."""

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
    where: MaybeText
    # the line the training code's thread is executing ("file.py:12 in fn"), for stall reports


@message
class Heartbeat(WorkerMessage, CoordinatorMessage):
    """Liveness, both ways; any message also counts as a heartbeat."""


# ------------------------------------------------------------------------ coordinator -> worker


@message
class OpenStore(CoordinatorMessage):
    """Sent to rank 0 only: open the data-plane store on port 0 and answer with StoreReady."""

    run_id: Text


@message
class Welcome(CoordinatorMessage):
    """The worker is in: its rank, the world, and where the data plane meets."""

    rank: int
    world_size: Positive
    run_id: Text
    backend: _Annotated[str, OneOf(Backend)]
    store_host: Text
    store_port: Port
    start_epoch: NonNeg
    epochs: Positive
    resume_epoch: NonNeg | None
    # load the checkpoint of this epoch before training; None: a fresh start
    checkpoint_dir: MaybeText
    # where checkpoints live (absolute; shared by all ranks); empty: checkpointing is off
    session: Session
    # this worker's session secret, as in its Joined (a Welcome may answer a retried hello)
    store_key: MaybeText = ""
    # the secret rank 0 put every data-plane store key under (StoreReady.key)

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
    """Run ``epoch`` with exactly these batch counts at this learning-rate factor."""

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
    train_metrics: tuple[Metric, ...] = ()
    # every named metric summed over all ranks, with the total sample count
    valid_metrics: tuple[Metric, ...] = ()

    def _validate(self) -> None:
        _check_metrics("train_metrics", self.train_metrics)
        _check_metrics("valid_metrics", self.valid_metrics)


@message
class Finish(CoordinatorMessage):
    """The run is over: restore the weights of ``best_epoch``, send Done, leave."""

    best_epoch: NonNeg | None
    best_loss: float | None
    epochs_run: NonNeg
    restore_best: bool
    # load the best epoch's weights (else keep the last epoch's)


@message
class Abort(CoordinatorMessage):
    """The run is stopped for every rank; ``reason`` says which rank, what and what to do."""

    reason: Text
