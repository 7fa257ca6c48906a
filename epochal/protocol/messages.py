"""The control-plane messages, one frozen dataclass each.

Every message a coordinator or worker may send is listed here and nowhere else. Each class checks
its own field ranges in ``__post_init__`` (raising ``ValueError``); the codec in
:mod:`epochal.protocol.codec` checks field types and turns any failure into
:class:`~epochal.errors.MalformedMessage`. ``docs/protocol.md`` describes the exchange.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

PROTOCOL_VERSION = 1
"""Bumped on any change to a message's fields or meaning; peers of other versions are refused."""

MAX_FRAME_BYTES = 16 * 1024 * 1024
"""Largest frame either side accepts (a hello with a large model's fingerprint fits easily)."""

MAX_TEXT_CHARS = 64 * 1024
"""Longest string field (reasons, names); longer reasons are cut by :func:`clip`."""

MAX_PARAMS = 100_000
"""Most parameter entries one fingerprint may list."""

BACKENDS = ("gloo", "nccl")
REJECT_CODES = ("refused", "not_member", "malformed", "version")

DEFAULT_JOB = "epochal"
"""Job name of a coordinator or worker that was given none."""

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _nonneg(name: str, value: int) -> None:
    _check(value >= 0, f"{name} must be >= 0, got {value}")


def _text(name: str, value: str, *, empty: bool = False) -> None:
    _check(len(value) <= MAX_TEXT_CHARS, f"{name} is longer than {MAX_TEXT_CHARS} characters")
    _check(empty or value != "", f"{name} must not be empty")


# ------------------------------------------------------------------------ shared parts


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One named parameter or buffer of a model: its shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        _text("parameter name", self.name)
        _text("dtype", self.dtype)
        _check(len(self.shape) <= 64, f"shape of {self.name} has more than 64 dimensions")
        _check(all(d >= 0 for d in self.shape), f"shape of {self.name} has a negative size")


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What must be identical on every rank: the model's parameters and the torch version."""

    digest: str
    # sha256 of the entries below, so equal fingerprints compare in O(1)
    params: tuple[ParamSpec, ...]
    torch_version: str

    def __post_init__(self) -> None:
        _text("digest", self.digest)
        _text("torch_version", self.torch_version)
        _check(len(self.params) <= MAX_PARAMS, f"fingerprint lists over {MAX_PARAMS} parameters")


# ------------------------------------------------------------------------ worker -> coordinator


@dataclass(frozen=True, slots=True)
class Hello:
    """A worker asks to join the run. Sent again, unchanged, while no answer comes."""

    job: str
    # the job name; must equal the coordinator's
    token: str
    # shared secret; empty when the coordinator requires none
    worker_id: str
    # unique per worker process; a second worker with the same id is a duplicate
    host: str
    pid: int
    rank_hint: int | None
    # the rank this worker asks for (the launcher passes its index); None: any
    device: str
    # "cpu" or "cuda": the coordinator picks the backend from every rank's device
    fingerprint: Fingerprint
    data_address: str = ""
    # the address this worker's data plane uses (for the coordinator's log); "": not given

    def __post_init__(self) -> None:
        _text("job", self.job)
        _text("token", self.token, empty=True)
        _text("worker_id", self.worker_id)
        _text("host", self.host)
        _text("data_address", self.data_address, empty=True)
        _nonneg("pid", self.pid)
        if self.rank_hint is not None:
            _nonneg("rank_hint", self.rank_hint)
        _check(self.device in ("cpu", "cuda"), f"device must be cpu or cuda, got {self.device!r}")


@dataclass(frozen=True, slots=True)
class StoreReady:
    """Rank 0 has opened the data-plane store and reports where it listens."""

    host: str
    port: int

    def __post_init__(self) -> None:
        _text("host", self.host)
        _check(0 < self.port < 65536, f"port must be in 1..65535, got {self.port}")


@dataclass(frozen=True, slots=True)
class EpochReady:
    """A worker is ready for ``epoch`` and holds this many batches."""

    epoch: int
    train_batches: int
    valid_batches: int | None
    # None: this worker has no validation loader at all

    def __post_init__(self) -> None:
        _nonneg("epoch", self.epoch)
        _nonneg("train_batches", self.train_batches)
        if self.valid_batches is not None:
            _nonneg("valid_batches", self.valid_batches)


@dataclass(frozen=True, slots=True)
class EpochReport:
    """A worker's loss sums for ``epoch``: per-sample loss summed, and the sample count."""

    epoch: int
    train_loss_sum: float
    train_count: int
    valid_loss_sum: float
    valid_count: int
    # 0 when the worker did not validate this epoch

    def __post_init__(self) -> None:
        _nonneg("epoch", self.epoch)
        _nonneg("train_count", self.train_count)
        _nonneg("valid_count", self.valid_count)


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """Rank 0 has committed the checkpoint of ``epoch`` (renamed into place, manifest written)."""

    epoch: int

    def __post_init__(self) -> None:
        _nonneg("epoch", self.epoch)


@dataclass(frozen=True, slots=True)
class Failed:
    """The worker hit an error it cannot recover from; the run must stop."""

    reason: str

    def __post_init__(self) -> None:
        _text("reason", self.reason)


@dataclass(frozen=True, slots=True)
class Done:
    """The worker has restored the best weights and is leaving."""


PHASES = ("rendezvous", "waiting", "train", "validate", "checkpoint", "finishing")


@dataclass(frozen=True, slots=True)
class Status:
    """A worker's heartbeat: where its training code is, so a stall can be located."""

    phase: str
    epoch: int
    step: int
    # batches done in this phase of this epoch
    where: str
    # the line the training code's thread is executing ("file.py:12 in fn"), for stall reports

    def __post_init__(self) -> None:
        _check(self.phase in PHASES, f"phase must be one of {PHASES}, got {self.phase!r}")
        _text("where", self.where, empty=True)
        _nonneg("epoch", self.epoch)
        _nonneg("step", self.step)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Liveness, both ways; any message also counts as a heartbeat."""


# ------------------------------------------------------------------------ coordinator -> worker


@dataclass(frozen=True, slots=True)
class OpenStore:
    """Sent to rank 0 only: open the data-plane store on port 0 and answer with StoreReady."""

    run_id: str

    def __post_init__(self) -> None:
        _text("run_id", self.run_id)


@dataclass(frozen=True, slots=True)
class Welcome:
    """The worker is in: its rank, the world, and where the data plane meets."""

    rank: int
    world_size: int
    run_id: str
    backend: str
    store_host: str
    store_port: int
    start_epoch: int
    epochs: int
    resume_epoch: int | None
    # load the checkpoint of this epoch before training; None: a fresh start
    checkpoint_dir: str
    # where checkpoints live (absolute; shared by all ranks); empty: checkpointing is off

    def __post_init__(self) -> None:
        _check(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        _text("checkpoint_dir", self.checkpoint_dir, empty=True)
        if self.resume_epoch is not None:
            _nonneg("resume_epoch", self.resume_epoch)
            _check(self.checkpoint_dir != "", "resume_epoch needs a checkpoint_dir")
        _check(
            0 <= self.rank < self.world_size, f"rank {self.rank} outside 0..{self.world_size - 1}"
        )
        _text("run_id", self.run_id)
        _check(self.backend in BACKENDS, f"backend must be one of {BACKENDS}, got {self.backend!r}")
        _text("store_host", self.store_host)
        _check(
            0 < self.store_port < 65536, f"store_port must be in 1..65535, got {self.store_port}"
        )
        _nonneg("start_epoch", self.start_epoch)
        _check(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")


@dataclass(frozen=True, slots=True)
class Joined:
    """The hello was accepted; the worker waits for the rest (sent again for a retried hello)."""

    joined: int
    world_size: int

    def __post_init__(self) -> None:
        _check(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        _check(
            0 < self.joined <= self.world_size, f"joined {self.joined} outside 1..{self.world_size}"
        )


@dataclass(frozen=True, slots=True)
class Reject:
    """This worker may not join, or the coordinator does not know it; the run goes on."""

    reason: str
    code: str
    # one of REJECT_CODES: "refused" (the hello was judged and refused), "not_member" (a message
    # other than hello from a peer the coordinator does not know, e.g. after a restart),
    # "malformed" or "version" (the frame could not be read)

    def __post_init__(self) -> None:
        _text("reason", self.reason)
        _check(self.code in REJECT_CODES, f"code must be one of {REJECT_CODES}, got {self.code!r}")


@dataclass(frozen=True, slots=True)
class Go:
    """Run ``epoch`` with exactly these batch counts at this learning-rate factor."""

    epoch: int
    train_batches: int
    valid_batches: int
    # 0: no validation this epoch
    lr_factor: float

    def __post_init__(self) -> None:
        _nonneg("epoch", self.epoch)
        _check(self.train_batches >= 1, f"train_batches must be >= 1, got {self.train_batches}")
        _nonneg("valid_batches", self.valid_batches)
        _check(math.isfinite(self.lr_factor), f"lr_factor must be finite, got {self.lr_factor}")


@dataclass(frozen=True, slots=True)
class Decision:
    """The coordinator's verdict on ``epoch``, identical for every rank."""

    epoch: int
    train_loss: float
    valid_loss: float | None
    # None: nobody validated this epoch
    smoothed_loss: float | None
    best_epoch: int | None
    is_best: bool
    # this epoch is the new best: keep its weights
    checkpoint: bool
    # write a checkpoint of the state after this epoch
    stop: bool
    # no further epoch; a Finish follows

    def __post_init__(self) -> None:
        _nonneg("epoch", self.epoch)
        if self.best_epoch is not None:
            _nonneg("best_epoch", self.best_epoch)


@dataclass(frozen=True, slots=True)
class Finish:
    """The run is over: restore the weights of ``best_epoch``, send Done, leave."""

    best_epoch: int | None
    best_loss: float | None
    epochs_run: int
    restore_best: bool
    # load the best epoch's weights (else keep the last epoch's)

    def __post_init__(self) -> None:
        _nonneg("epochs_run", self.epochs_run)
        if self.best_epoch is not None:
            _nonneg("best_epoch", self.best_epoch)


@dataclass(frozen=True, slots=True)
class Abort:
    """The run is stopped for every rank; ``reason`` says which rank, what and what to do."""

    reason: str

    def __post_init__(self) -> None:
        _text("reason", self.reason)


WorkerMessage = (
    Hello
    | StoreReady
    | EpochReady
    | EpochReport
    | Checkpointed
    | Failed
    | Done
    | Status
    | Heartbeat
)
CoordinatorMessage = (
    Joined | OpenStore | Welcome | Reject | Go | Decision | Finish | Abort | Heartbeat
)
Message = WorkerMessage | CoordinatorMessage

MESSAGE_TYPES: dict[str, type] = {
    "hello": Hello,
    "store_ready": StoreReady,
    "epoch_ready": EpochReady,
    "epoch_report": EpochReport,
    "checkpointed": Checkpointed,
    "failed": Failed,
    "done": Done,
    "heartbeat": Heartbeat,
    "status": Status,
    "joined": Joined,
    "open_store": OpenStore,
    "welcome": Welcome,
    "reject": Reject,
    "go": Go,
    "decision": Decision,
    "finish": Finish,
    "abort": Abort,
}
"""Wire name of every message type; the codec refuses any other."""

TYPE_NAMES: dict[type, str] = {cls: name for name, cls in MESSAGE_TYPES.items()}
