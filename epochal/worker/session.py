"""Joining a run and following the coordinator's epochs: the worker API's lower level.

:func:`join` performs the rendezvous (retrying with backoff until the coordinator answers or the
connect deadline passes), opens the data-plane process group, and returns a :class:`Session`.
:meth:`Session.run_epochs` is lamp's ``epochs`` loop with the decisions taken by the coordinator:
the user supplies a train-epoch function and a validation function; the session announces batch
counts, waits for Go, runs them, reports the loss sums and follows the Decision.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from epochal.addressfile import file_path, wait_for
from epochal.environment import (
    CONNECT_TIMEOUT_ENV,
    COORDINATOR_ENV,
    JOB_ENV,
    REATTACH_TIMEOUT_ENV,
    TOKEN_ENV,
    WORKER_ID_ENV,
)
from epochal.errors import (
    ConfigError,
    CoordinatorLost,
    CoordinatorUnreachable,
    EpochalError,
    JoinRefused,
    RunAborted,
)
from epochal.protocol import (
    DEFAULT_JOB,
    Checkpointed,
    Decision,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Finish,
    Go,
    Hello,
    Joined,
    OpenStore,
    Phase,
    Reject,
    StoreReady,
    Welcome,
    check_job_name,
    clip,
)
from epochal.security.curve import ClientSecurity
from epochal.worker import faults, launchenv, network
from epochal.worker.checkpoint import CheckpointCorrupt, Checkpointer
from epochal.worker.client import ControlClient
from epochal.worker.exits import install as install_excepthook
from epochal.worker.fingerprint import fingerprint
from epochal.worker.state import Stateful
from epochal.worker.store import connect_store, new_key, open_store, scoped
from epochal.worker.waiting import WaitNotices


@dataclass(frozen=True, slots=True)
class LossSum:
    """A loss summed over samples (``total``) and how many samples that was (``count``)."""

    total: float
    count: int


@dataclass(frozen=True, slots=True)
class EpochContext:
    """What the coordinator said about the epoch about to run; identical on every rank."""

    epoch: int
    train_batches: int
    valid_batches: int
    # 0: no validation this epoch
    lr_factor: float
    rank: int
    world_size: int
    session: Session

    def check(self) -> None:
        """Raise RunAborted if the run was aborted; call it between batches of a custom loop."""
        self.session.client.check()


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """One point of the learning curve."""

    epoch: int
    train_loss: float
    valid_loss: float | None
    smoothed_loss: float | None
    lr_factor: float
    seconds: float


@dataclass(frozen=True, slots=True)
class RunResult:
    """How the run went: the best epoch, its figures, and the whole learning curve."""

    best_epoch: int | None
    best_loss: float | None
    # smoothed monitored loss of the best epoch
    epochs_run: int
    rank: int
    world_size: int
    curve: list[EpochRecord] = field(default_factory=list)
    restore_best: bool = True
    # whether the coordinator asks for the best epoch's weights at the end
    weights_note: str | None = None
    # set when the model does not hold the weights it should (the best epoch's, when
    # restore_best): which weights it holds instead, and why

    @property
    def best(self) -> EpochRecord | None:
        """The learning-curve record of the best epoch."""
        return next((r for r in self.curve if r.epoch == self.best_epoch), None)


def _env_float(name: str, default: float, *, allow_zero: bool = False) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not (value >= 0 if allow_zero else value > 0):
        raise ConfigError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


def _check_endpoint(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("tcp", "ipc", "inproc") or not (parts.netloc or parts.path):
        raise ConfigError(
            f"coordinator address {endpoint!r} is not a ZeroMQ endpoint: use tcp://HOST:PORT "
            f"(pass coordinator=... or set {COORDINATOR_ENV})"
        )
    if parts.scheme == "tcp" and (parts.port is None or parts.port == 0):
        raise ConfigError(
            f"coordinator address {endpoint!r} has no port: use the address the coordinator "
            "printed when it started, e.g. tcp://127.0.0.1:29400"
        )
    return endpoint


def _read_address_file(spec: str, deadline_s: float) -> tuple[str, float]:
    """Resolve ``file:PATH`` to the address in that file; return it and the time left."""
    path = file_path(spec)
    if path is None:
        return spec, deadline_s
    started = time.monotonic()
    endpoint = wait_for(
        path, deadline_s, say=lambda line: print(f"epochal: {line}", file=sys.stderr, flush=True)
    )
    return endpoint, max(0.1, deadline_s - (time.monotonic() - started))


def advertised_host(endpoint: str) -> str:
    """The address of this machine that the coordinator's peers can reach.

    ``EPOCHAL_HOST`` wins, then ``EPOCHAL_IFNAME``'s address; a loopback coordinator means a
    single-machine run (127.0.0.1); otherwise the local address of the route to the coordinator
    (see :mod:`epochal.worker.network`).
    """
    return network.discover(endpoint).address


class Session:
    """One worker's membership in a run: rank, world, the control client and the process group."""

    def __init__(
        self,
        client: ControlClient,
        welcome: Welcome,
        device: torch.device,
        store: _StoreRef,
        *,
        hello: Hello,
        endpoint: str,
        reattach_timeout: float,
        store_timeout: float,
    ) -> None:
        self.client = client
        self.rank = welcome.rank
        self.world_size = welcome.world_size
        self.backend = welcome.backend
        self.device = device
        self._store = store  # rank 0 hosts it: it must live as long as the process group
        self._hello = hello
        self._endpoint = endpoint
        self._reattach_timeout = reattach_timeout
        self._store_timeout = store_timeout
        self._closed = False
        client.rank = self.rank
        self._adopt(welcome)

    def _adopt(self, welcome: Welcome) -> None:
        self.run_id = welcome.run_id
        self.start_epoch = welcome.start_epoch
        self.epochs = welcome.epochs
        self.resume_epoch = welcome.resume_epoch
        self.checkpointer = (
            Checkpointer(Path(welcome.checkpoint_dir), rank=self.rank, run_id=self.run_id)
            if welcome.checkpoint_dir
            else None
        )

    def _reattach(self, lost: CoordinatorLost, waiting: tuple[type[Any], ...]) -> Any:
        """Say hello again after losing the coordinator; carry on, or resume from a checkpoint.

        The coordinator that answers is either the same one, which was only stalled (its process
        stopped, its machine suspended) and still runs this run with this worker in it, or a
        restarted one. The same one answers with the message this worker was waiting for
        (``waiting``), queued while it was stalled, or with a ``welcome`` carrying this run's id
        and this worker's session: that answer is returned and the exchange goes on where it was
        (a ``welcome`` is skipped by :meth:`_expect`, as any answer to a retried hello). A
        restarted coordinator issues a new session: the worker adopts its ``welcome`` and raises
        :class:`_TakenBack`, so that :meth:`run_epochs` resumes from its last checkpoint.
        """
        if self._reattach_timeout <= 0:
            raise lost
        print(
            f"epochal: rank {self.rank}: {lost.reason}; waiting up to {self._reattach_timeout:g} s "
            "for a coordinator to take this worker back",
            file=sys.stderr,
            flush=True,
        )
        session = self.client.session
        hello = replace(self._hello, rank_hint=self.rank)
        stalled_since = time.monotonic()
        try:
            welcome, _ = _rendezvous(
                self.client,
                hello,
                self._endpoint,
                self._reattach_timeout,
                self._store_timeout,
                store=self._store,
                answers=waiting,
            )
        except _StillRunning as running:
            return self._carry_on(running.message, stalled_since)
        except (CoordinatorUnreachable, JoinRefused) as exc:
            raise CoordinatorLost(f"{lost.reason}; and then: {exc}") from None
        if welcome.run_id == self.run_id and welcome.session == session:
            return self._carry_on(welcome, stalled_since)
        same = (welcome.rank, welcome.world_size, welcome.backend)
        if same != (self.rank, self.world_size, self.backend):
            raise CoordinatorLost(
                f"the restarted coordinator gave rank {welcome.rank} of {welcome.world_size} "
                f"({welcome.backend}) to what was rank {self.rank} of {self.world_size} "
                f"({self.backend}): the running process group cannot change; restart the run"
            )
        if welcome.resume_epoch is None:
            raise CoordinatorLost(
                "the restarted coordinator has no committed checkpoint to resume from, so the "
                "workers cannot carry on: start the run again"
            )
        self._adopt(welcome)
        print(
            f"epochal: rank {self.rank}: re-attached to run {self.run_id}; resuming after epoch "
            f"{welcome.resume_epoch}",
            file=sys.stderr,
            flush=True,
        )
        raise _TakenBack

    def _carry_on(self, answer: Any, stalled_since: float) -> Any:
        """The coordinator that was lost answered again: it was stalled, not gone; go on."""
        self.client.watch_coordinator()
        print(
            f"epochal: rank {self.rank}: the coordinator of run {self.run_id} answered again after "
            f"{time.monotonic() - stalled_since:.1f} s (it was stalled, not restarted); carrying "
            f"on where this worker was (epoch {self.client.epoch})",
            file=sys.stderr,
            flush=True,
        )
        return answer

    # ------------------------------------------------------------------ the loop

    def run_epochs(
        self,
        train_epoch: Callable[[EpochContext], LossSum],
        valid_epoch: Callable[[EpochContext], LossSum] | None = None,
        *,
        batches: tuple[int, int | None] | Callable[[int], tuple[int, int | None]],
        on_best: Callable[[int], None] | None = None,
        state: Stateful | None = None,
    ) -> RunResult:
        """Run epochs until the coordinator says stop, then wait for Finish.

        ``batches`` is ``(train_batches, valid_batches)`` this rank holds (``valid_batches`` None
        when it has no validation data), or a function of the epoch returning that. The functions
        receive an :class:`EpochContext` and must run exactly ``ctx.train_batches`` /
        ``ctx.valid_batches`` batches, returning the summed loss and the sample count.
        ``on_best(epoch)`` runs when the coordinator declares the epoch the new best.

        ``state`` is what a checkpoint holds: an object with ``state_dict()`` and
        ``load_state_dict(sd)`` (``torch.distributed.checkpoint``'s Stateful protocol), saved when
        the coordinator asks and loaded before the first epoch when it resumes the run. Without
        it the run is not checkpointed and cannot be resumed.
        """
        curve: list[EpochRecord] = []
        try:
            curve = self._resume(state)
            epoch = self.start_epoch
            stopped = False
            while True:
                try:
                    if stopped:
                        self.client.at(Phase.FINISHING, epoch)
                        finish = self._expect(Finish)
                        break
                    outcome = self._epoch(epoch, train_epoch, valid_epoch, batches, state, curve)
                except _TakenBack:  # by a restarted coordinator: go on from its checkpoint
                    self._resume(state)
                    epoch, stopped = self.start_epoch, False
                    curve = [r for r in curve if r.epoch < epoch]
                    continue
                if isinstance(outcome, Finish):  # a resumed run that had already stopped
                    finish = outcome
                    break
                decision, record = outcome
                curve.append(record)
                if decision.is_best and on_best is not None:
                    on_best(decision.epoch)
                stopped = decision.stop
                epoch += 1
            self.client.send(Done())
        except (RunAborted, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.fail(exc)
            raise
        return RunResult(
            restore_best=finish.restore_best,
            best_epoch=finish.best_epoch,
            best_loss=finish.best_loss,
            epochs_run=finish.epochs_run,
            rank=self.rank,
            world_size=self.world_size,
            curve=curve,
        )

    def _epoch(
        self,
        epoch: int,
        train_epoch: Callable[[EpochContext], LossSum],
        valid_epoch: Callable[[EpochContext], LossSum] | None,
        batches: tuple[int, int | None] | Callable[[int], tuple[int, int | None]],
        state: Stateful | None,
        curve: list[EpochRecord],
    ) -> tuple[Decision, EpochRecord] | Finish:
        """One epoch's exchange with the coordinator; Finish when the run is over instead."""
        train_batches, valid_batches = batches(epoch) if callable(batches) else batches
        if valid_epoch is None:
            valid_batches = None
        self.client.at(Phase.WAITING, epoch)
        self.client.send(EpochReady(epoch, train_batches, valid_batches))
        go = self._expect(Go, Finish)
        if isinstance(go, Finish):
            return go
        ctx = EpochContext(
            epoch=go.epoch,
            train_batches=go.train_batches,
            valid_batches=go.valid_batches,
            lr_factor=go.lr_factor,
            rank=self.rank,
            world_size=self.world_size,
            session=self,
        )
        started = time.monotonic()
        self.client.at(Phase.TRAIN, epoch)
        train = train_epoch(ctx)
        valid = LossSum(0.0, 0)
        if valid_epoch is not None and go.valid_batches > 0:
            self.client.at(Phase.VALIDATE, epoch)
            valid = valid_epoch(ctx)
        self.client.at(Phase.WAITING, epoch)
        self.client.send(
            EpochReport(
                epoch=epoch,
                train_loss_sum=float(train.total),
                train_count=int(train.count),
                valid_loss_sum=float(valid.total),
                valid_count=int(valid.count),
            )
        )
        faults.hit("epoch-end", rank=self.rank, epoch=epoch)
        decision = self._expect(Decision)
        record = EpochRecord(
            epoch=decision.epoch,
            train_loss=decision.train_loss,
            valid_loss=decision.valid_loss,
            smoothed_loss=decision.smoothed_loss,
            lr_factor=go.lr_factor,
            seconds=time.monotonic() - started,
        )
        if decision.checkpoint and state is not None:
            self.client.at(Phase.CHECKPOINT, epoch)
            self._save(decision.epoch, state, [*curve, record])
        return decision, record

    def _resume(self, state: Stateful | None) -> list[EpochRecord]:
        """Load the checkpoint the coordinator resumes from; the learning curve up to it."""
        if self.resume_epoch is None:
            return []
        if state is None or self.checkpointer is None:
            raise EpochalError(
                f"the coordinator resumes this run after epoch {self.resume_epoch}, but there is "
                "no state to load it into: pass state= to run_epochs (or use epochal.train)"
            )
        history = self.checkpointer.load(self.resume_epoch, state)
        if not isinstance(history, list):  # a checkpoint written before curves were kept
            return []
        return [
            EpochRecord(**r)
            for r in history
            if isinstance(r, dict) and r["epoch"] <= self.resume_epoch
        ]

    def _save(self, epoch: int, state: Stateful, curve: list[EpochRecord]) -> None:
        if self.checkpointer is None:
            return
        history = [asdict(r) for r in curve]
        if self.checkpointer.save(epoch, state, history=history) is not None:
            self.client.send(Checkpointed(epoch=epoch))  # rank 0, once the rename is durable

    def load_checkpoint(self, epoch: int, state: Stateful) -> None:
        """Collective: load ``epoch``'s committed checkpoint into ``state`` (RNGs untouched).

        Raises :class:`~epochal.worker.checkpoint.CheckpointCorrupt` (nothing loaded) when the
        checkpoint does not match its manifest.
        """
        if self.checkpointer is None:
            raise EpochalError("this run has no checkpoint directory")
        self.checkpointer.load(epoch, state, rng=False)

    def restore_best(self, result: RunResult, state: Stateful) -> RunResult:
        """Collective: load the best epoch's checkpoint into ``state`` at the end of the run.

        A damaged checkpoint is never loaded: ``state`` keeps the last epoch's weights, and the
        returned result says so in ``weights_note`` (also printed), rather than claiming the best.
        """
        if result.best_epoch is None:
            return result
        try:
            self.load_checkpoint(result.best_epoch, state)
        except CheckpointCorrupt as exc:
            last = max((r.epoch for r in result.curve), default=None)
            note = (
                f"{exc}; the model keeps the weights of the last epoch trained ({last}) instead "
                f"of the best epoch's ({result.best_epoch})"
            )
            print(f"epochal: rank {self.rank}: {note}", file=sys.stderr, flush=True)
            return replace(result, weights_note=note)
        return result

    def fail(self, exc: BaseException) -> None:
        """Tell the coordinator this rank cannot go on, so every other rank stops too."""
        lines = traceback.format_exception_only(type(exc), exc)
        self.client.send(Failed(reason=clip("".join(lines).strip())))

    def _expect(self, *kinds: type[Any]) -> Any:
        while True:
            try:
                message = self.client.receive()
            except CoordinatorLost as lost:
                message = self._reattach(lost, kinds)
            if isinstance(message, kinds):
                return message
            if isinstance(message, Welcome | Joined):
                continue  # an answer to a retried hello
            expected = " or ".join(k.__name__ for k in kinds)
            raise EpochalError(
                f"expected {expected} from the coordinator, got {type(message).__name__}: "
                "the worker and the coordinator are out of step (mixed epochal versions?)"
            )

    def close(self) -> None:
        """Leave the process group and stop the control client. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # tearing down after an abort: the peers may be gone already
                pass
        self.client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_for(local_rank: int, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def join(
    model: torch.nn.Module,
    *,
    coordinator: str | None = None,
    job: str | None = None,
    token: str | None = None,
    worker_id: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    device: str | torch.device | None = None,
    connect_timeout: float | None = None,
    collective_timeout: float = 600.0,
    heartbeat_interval: float = 1.0,
    heartbeat_timeout: float = 15.0,
    abort_grace: float = 2.0,
    reattach_timeout: float | None = None,
    curve_key: str | os.PathLike[str] | None = None,
    curve_server_key: str | os.PathLike[str] | None = None,
) -> Session:
    """Join the run the coordinator holds and return this worker's Session.

    Every argument left None comes from its environment variable (see
    :mod:`epochal.environment`), then from the default. ``connect_timeout`` (default 120 s) bounds
    the time to reach the coordinator and be admitted; after that the coordinator's own
    rendezvous timeout applies. ``collective_timeout`` bounds each data-plane collective.
    ``reattach_timeout`` (default 60 s, 0: never) is how long a worker whose coordinator vanished
    waits for a restarted one to take it back; the run then resumes from its last checkpoint.
    ``curve_key`` (this worker's ``.key_secret`` file, else ``EPOCHAL_CURVE_KEY``) and
    ``curve_server_key`` (the coordinator's ``coordinator.key``, else
    ``EPOCHAL_CURVE_SERVER_KEY``) turn on CURVE for a coordinator that has keys.

    ``coordinator`` may be ``file:PATH``: the worker waits (within ``connect_timeout``) for the
    address file ``epochal coordinator --address-file PATH`` writes. ``rank`` (a hint),
    ``world_size`` (the size this worker expects; a coordinator with another is refused) and the
    local device default to ``EPOCHAL_RANK``/``EPOCHAL_WORLD_SIZE``/``EPOCHAL_LOCAL_RANK``, then to
    what torchrun, Slurm or a Kubernetes Indexed Job set (:mod:`epochal.worker.launchenv`).
    """
    endpoint = coordinator or os.environ.get(COORDINATOR_ENV)
    if not endpoint:
        raise ConfigError(
            f"no coordinator address: pass coordinator='tcp://HOST:PORT' or set {COORDINATOR_ENV}, "
            "or start the script with `epochal run --nproc N SCRIPT`"
        )
    deadline_s = (
        connect_timeout if connect_timeout is not None else _env_float(CONNECT_TIMEOUT_ENV, 120.0)
    )
    endpoint, deadline_s = _read_address_file(endpoint, deadline_s)
    endpoint = _check_endpoint(endpoint)
    try:
        job = check_job_name(job or os.environ.get(JOB_ENV) or DEFAULT_JOB)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    token = token if token is not None else os.environ.get(TOKEN_ENV, "")
    host = socket.gethostname()
    worker_id = (
        worker_id or os.environ.get(WORKER_ID_ENV) or f"{host}/{os.getpid()}/{uuid.uuid4().hex[:6]}"
    )
    where = launchenv.placement(os.environ, rank=rank, world_size=world_size)
    rank_hint, local_rank = where.rank, where.local_rank
    reattach = (
        reattach_timeout
        if reattach_timeout is not None
        else _env_float(REATTACH_TIMEOUT_ENV, 60.0, allow_zero=True)
    )
    if not reattach >= 0:
        raise ConfigError(f"reattach_timeout must be >= 0 seconds (0: never), got {reattach}")
    for name, value in (
        ("collective_timeout", collective_timeout),
        ("connect_timeout", deadline_s),
        ("heartbeat_interval", heartbeat_interval),
        ("abort_grace", abort_grace),
    ):
        if not value > 0:
            raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
    if heartbeat_timeout <= heartbeat_interval:
        raise ConfigError("heartbeat_timeout must exceed heartbeat_interval")
    dev = _device_for(local_rank, device)
    plane = network.discover(endpoint)  # refuses an unusable network before joining
    security = ClientSecurity.from_env(key_file=curve_key, server_key_file=curve_server_key)

    client = ControlClient(
        endpoint,
        identity=worker_id.encode()[:255],
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        abort_grace=abort_grace,
        reattach=reattach > 0,
        security=security,
    )
    # from here on, an error that stops the run ends the process with one line, no traceback
    install_excepthook(aborted=lambda: client._abort_reason)
    client.start()
    try:
        hello = Hello(
            job=job,
            token=token,
            worker_id=worker_id,
            host=host,
            pid=os.getpid(),
            rank_hint=rank_hint,
            device="cuda" if dev.type == "cuda" else "cpu",
            fingerprint=fingerprint(model),
            data_address=plane.address,
        )
        welcome, store = _rendezvous(client, hello, endpoint, deadline_s, collective_timeout)
        mismatch = launchenv.check_world_size(where, welcome.world_size)
        if mismatch is not None:
            client.send(Failed(reason=clip(mismatch)))  # so the coordinator aborts at once
            raise JoinRefused(mismatch)
        if welcome.backend == "nccl" and dev.type != "cuda":
            raise ConfigError("the coordinator chose nccl but this worker has no CUDA device")
        faults.hit("connect", rank=welcome.rank)
        network.apply(plane, os.environ)  # gloo and NCCL read their interface at init
        dist.init_process_group(
            backend=welcome.backend,
            store=scoped(store.store, welcome.run_id, store.key),
            rank=welcome.rank,
            world_size=welcome.world_size,
            timeout=timedelta(seconds=collective_timeout),
            device_id=dev if dev.type == "cuda" else None,
        )
        client.at(Phase.SETUP, welcome.start_epoch)
    except CoordinatorUnreachable:
        client.close(flush=0.5)
        raise
    except BaseException as exc:
        _tell_join_failure(client, exc)
        client.close(flush=0.5)
        raise
    return Session(
        client,
        welcome,
        dev,
        store,
        hello=hello,
        endpoint=endpoint,
        reattach_timeout=reattach,
        store_timeout=collective_timeout,
    )


def _tell_join_failure(client: ControlClient, exc: BaseException) -> None:
    """Send the coordinator the error that ended this worker's join, naming the phase it hit.

    Without it, a worker whose data plane cannot connect (gloo's ``connectFullMesh failed``) is
    seen by the coordinator only as a silence. A refused or aborted worker is not told again.
    """
    if isinstance(exc, JoinRefused | RunAborted) or not isinstance(exc, Exception):
        return
    error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    client.send(Failed(reason=clip(f"{client.phase.description} failed: {error}")))


class _TakenBack(Exception):
    """A restarted coordinator took this worker back: resume from the checkpoint it names."""


class _StillRunning(Exception):
    """During a re-attach, the lost coordinator sent what the worker was waiting for."""

    def __init__(self, message: Any) -> None:
        super().__init__(type(message).__name__)
        self.message = message


@dataclass(slots=True)
class _StoreRef:
    """The data-plane store this worker uses, and the host it was reached at."""

    store: TCPStore
    host: str
    port: int
    key: str
    # the secret the process group's keys live under (see epochal.worker.store)


def _rendezvous(
    client: ControlClient,
    hello: Hello,
    endpoint: str,
    deadline_s: float,
    store_timeout: float,
    store: _StoreRef | None = None,
    answers: tuple[type[Any], ...] = (),
) -> tuple[Welcome, _StoreRef]:
    """Say hello until admitted, open (rank 0) or find the store, and return the Welcome.

    ``store`` is the store of a running process group (a re-attach): it is reused, not reopened.
    ``answers`` (a re-attach) are the messages the worker waited for when it lost the coordinator:
    only the coordinator that admitted it sends one, so one arriving raises :class:`_StillRunning`.
    """
    started = time.monotonic()
    deadline = started + deadline_s
    notices = WaitNotices(endpoint, deadline_s, started, announced=store is not None)
    backoff = 0.1
    joined = False
    client.send(hello)
    while True:
        try:
            wait = min(backoff, max(deadline - time.monotonic(), 0.01))  # never past the deadline
            message = client.receive(timeout=None if joined else wait)
        except TimeoutError:
            now = time.monotonic()
            if now > deadline:
                raise CoordinatorUnreachable(
                    f"no coordinator answered at {endpoint} within {deadline_s:g} s: start it "
                    f"first (epochal coordinator --bind ...), or check the address "
                    f"({COORDINATOR_ENV}) and that no firewall blocks the port; "
                    f"{CONNECT_TIMEOUT_ENV} sets how long a worker waits"
                ) from None
            notice = notices.due(now)
            if notice is not None:
                print(notice, file=sys.stderr, flush=True)
            backoff = min(backoff * 2, 2.0, max(0.1, deadline - now))
            client.send(hello)
            continue
        match message:
            case Joined():
                if not joined:
                    joined = True
                    client.watch_coordinator()
            case Reject(code="not_member"):
                pass  # the answer to a message queued before this hello: not about the hello
            case Reject(reason=reason):
                raise JoinRefused(f"the coordinator at {endpoint} refused this worker: {reason}")
            case OpenStore():
                if store is None:
                    client.at(Phase.CONNECT, 0)
                    host = advertised_host(endpoint)
                    master = open_store(host, store_timeout)
                    store = _StoreRef(master, host, master.port, new_key())
                client.send(StoreReady(host=store.host, port=store.port, key=store.key))
            case Welcome():
                if store is None:
                    client.at(Phase.CONNECT, message.start_epoch)
                    found = connect_store(message.store_host, message.store_port, store_timeout)
                    store = _StoreRef(
                        found, message.store_host, message.store_port, message.store_key
                    )
                return message, store
            case _ if isinstance(message, answers):
                raise _StillRunning(message)
            case _:
                raise EpochalError(
                    f"unexpected {type(message).__name__} from the coordinator during rendezvous"
                )
