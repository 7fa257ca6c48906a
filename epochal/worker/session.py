"""Following the coordinator's epochs: the worker API's lower level.

A :class:`Session` is one worker's membership in a run (:func:`~epochal.worker.join.join`
makes it). :meth:`Session.run_epochs` is lamp's ``epochs`` loop with the decisions taken by the
coordinator: the user supplies a train-epoch function and a validation function; the session
announces batch counts, waits for Go, runs them, reports the loss sums and follows the Decision.
One exchange lies between two trainings: each loss report carries this rank's batch counts for
the next epoch, and each decision that does not stop the run carries the next epoch's Go. Only
the first epoch of a run (or of a resume) is announced on its own (``epoch_ready`` -> ``go``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from epochal.errors import (
    CoordinatorLost,
    EpochalError,
    RunAborted,
)
from epochal.protocol import (
    Awaiting,
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
    Phase,
    Regroup,
    SnapshotScope,
    Welcome,
    clip,
)
from epochal.worker import faults
from epochal.worker.checkpointing import Checkpointing
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.checkpoints.state import Stateful
from epochal.worker.control.client import ControlClient, RegroupNow
from epochal.worker.control.exits import failure_reason
from epochal.worker.control.finish import finish_without_epochs
from epochal.worker.control.progress import CpuProgress, thread_cpu
from epochal.worker.control.rendezvous import StoreRef
from epochal.worker.control.worlds import Rejoin
from epochal.worker.dataplane.sockets import GroupSockets
from epochal.worker.reattaching import Reattaching, TakenBack
from epochal.worker.regroup.leave import close_group
from epochal.worker.regrouping import Regrouping
from epochal.worker.training.replicas import weights_checksum
from epochal.worker.training.results import (
    EpochContext,
    EpochRecord,
    LossSum,
    RunResult,
    metric_values,
    wire_metrics,
)

__all__ = ["EpochContext", "EpochRecord", "LossSum", "Rejoin", "RunResult", "Session"]


class Session(Checkpointing, Reattaching, Regrouping):
    """One worker's membership in a run: rank, world, the control client and the process group."""

    def __init__(
        self,
        client: ControlClient,
        welcome: Welcome,
        device: torch.device,
        store: StoreRef,
        *,
        hello: Hello,
        endpoint: str,
        reattach_timeout: float,
        store_timeout: float,
        model: torch.nn.Module | None = None,
        sockets: GroupSockets | None = None,
    ) -> None:
        self.client = client
        self._sockets = sockets if sockets is not None else GroupSockets({})
        # the process group's connections, shut when this rank leaves it for a new world
        self.model = model
        # the model whose weights every rank compares after each epoch (the one given to join);
        # None: nothing compared
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
        self._learning_rate: Callable[[], float] | None = None
        self._ran_epochs = False  # run_epochs was called: this run's epochs are epochal's
        self._asked: EpochReady | EpochReport | None = None
        # the epoch_ready or epoch_report whose answer this rank awaits (sent again to a restarted
        # coordinator that takes it back where it is)
        self._saved: int | None = None
        # the epoch of the last checkpoint this rank committed (rank 0; sent again likewise)
        self._decided: int | None = None
        # the last epoch whose decision this rank has (one sent again is skipped)
        client.busy = CpuProgress(thread_cpu(threading.get_ident()))
        # until run_epochs: a loop of the script's own, whose progress is the CPU it uses
        client.rank = self.rank
        self._adopt(welcome)

    def _adopt(self, welcome: Welcome) -> None:
        self.run_id = welcome.run_id
        self.generation = welcome.generation
        self.client.on_regroup = self._leave_now  # see _leave_now
        self.restore = welcome.restore
        # how this world's members take the state of start_epoch (Restore): "peers" means
        # newcomers joined, and every rank takes rank 0's state over the data plane
        self.elastic = welcome.elastic
        # the run goes on without a lost rank: each epoch's start is kept (Rejoin)
        self.start_epoch = welcome.start_epoch
        self.epochs = welcome.epochs
        self.resume_epoch = welcome.resume_epoch
        self._replica_check = welcome.replica_check
        self.checkpointer = (
            Checkpointer(Path(welcome.checkpoint_dir), rank=self.rank, run_id=self.run_id)
            if welcome.checkpoint_dir
            else None
        )

    # ------------------------------------------------------------------ the loop

    def run_epochs(
        self,
        train_epoch: Callable[[EpochContext], LossSum],
        valid_epoch: Callable[[EpochContext], LossSum] | None = None,
        *,
        batches: tuple[int, int | None] | Callable[[int], tuple[int, int | None]],
        on_best: Callable[[int], None] | None = None,
        state: Stateful | None = None,
        rejoin: Rejoin | None = None,
        learning_rate: Callable[[], float] | None = None,
    ) -> RunResult:
        """Run epochs until the coordinator says stop, then wait for Finish.

        ``batches`` is ``(train_batches, valid_batches)`` this rank holds (``valid_batches`` None
        when it has no validation data), or a function of the epoch returning that; the function
        is asked for an epoch's counts before it starts (for every epoch but the first, when the
        previous epoch's loss report is sent, which carries them), never for an epoch past the
        run's last. The functions
        receive an :class:`EpochContext` and must run exactly ``ctx.train_batches`` /
        ``ctx.valid_batches`` batches, returning the summed loss and the sample count.
        ``on_best(epoch)`` runs when the coordinator declares the epoch the new best.

        ``state`` is what a checkpoint holds: an object with ``state_dict()`` and
        ``load_state_dict(sd)`` (``torch.distributed.checkpoint``'s Stateful protocol), saved when
        the coordinator asks and loaded before the first epoch when it resumes the run. Without
        it the run is not checkpointed and cannot be resumed.

        ``rejoin`` lets the loop go on in a new world when the run is elastic (``--min-workers``)
        and a rank is lost: its ``leave()`` drops every reference to the process group, its
        ``rebuild(epoch)`` builds over the new one and restores the start of ``epoch`` (which is
        then run again at the new rank and world size). Without it a lost rank ends the run.

        ``learning_rate()`` is the rate the optimizer holds now (``lambda:
        optimizer.param_groups[0]["lr"]``); asked when each epoch is reported, it is what the
        coordinator's epoch line shows (``lr 0.05``) and its journal keeps. Without it the line
        shows the coordinator's factor (``lr x1``).
        """
        self._learning_rate = learning_rate
        self._ran_epochs = True
        self.client.busy = None  # from here on the epochs' steps say the progress
        curve: list[EpochRecord] = []
        try:
            curve = self._resume(state)
            epoch = self.start_epoch
            stopped = False
            go: Go | None = None  # the Go the last decision carried; None: announce the epoch
            while True:
                try:
                    if stopped:  # after the last epoch decided, not in one past it
                        self.client.at(Phase.FINISHING, epoch - 1)
                        finish = self._expect(Finish)
                        break
                    outcome = self._epoch(
                        epoch, go, train_epoch, valid_epoch, batches, state, curve, rejoin, on_best
                    )
                except TakenBack:  # by a restarted coordinator: go on from its checkpoint
                    self._resume(state)
                    epoch, stopped, go = self.start_epoch, False, None
                    curve = [r for r in curve if r.epoch < epoch]
                    continue
                except RegroupNow as now:
                    regroup: Regroup | None = now.regroup
                    error: BaseException | None = now
                except (RunAborted, KeyboardInterrupt, CoordinatorLost):
                    raise
                except Exception as exc:
                    if not self.elastic or rejoin is None:
                        raise
                    regroup, error = self._broken(epoch, exc), exc
                else:
                    regroup = error = None
                if regroup is not None:  # outside the handler, which holds the old group
                    epoch, restored = self._regroup(regroup, rejoin, error)
                    error = None
                    state = restored if restored is not None else state
                    stopped, go = False, None
                    curve = [r for r in curve if r.epoch < epoch]
                    continue
                if isinstance(outcome, Finish):  # a resumed run that had already stopped
                    finish = outcome
                    break
                decision = outcome
                stopped, go = decision.stop, decision.go
                epoch += 1
            self.client.send(Done())
        except (RunAborted, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:  # the training code's: it may hold a wrapper and, through it, the process group
            self._learning_rate = None
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
        go: Go | None,
        train_epoch: Callable[[EpochContext], LossSum],
        valid_epoch: Callable[[EpochContext], LossSum] | None,
        batches: tuple[int, int | None] | Callable[[int], tuple[int, int | None]],
        state: Stateful | None,
        curve: list[EpochRecord],
        rejoin: Rejoin | None,
        on_best: Callable[[int], None] | None,
    ) -> Decision | Finish:
        """One epoch's exchange with the coordinator; Finish when the run is over instead. The
        decided epoch joins ``curve`` (and ``on_best`` keeps it) before the checkpoint the
        decision may ask for: a change of world that breaks the checkpoint's collectives keeps
        what was decided.

        ``go``: the Go of ``epoch`` the previous decision carried; None (the first epoch of a run
        or of a resume): the epoch is announced with an epoch_ready and its Go awaited."""
        if go is None:
            self.client.at(Phase.WAITING, epoch, Awaiting.GO, announce=False)  # the ready says it
            self._ask(_ready(epoch, batches, valid_epoch, self.generation, rejoin))
            answer = self._expect(Go, Finish)
            self._asked = None
            if isinstance(answer, Finish):
                return answer
            go = answer
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
        # the report says that it waits
        self.client.at(Phase.WAITING, epoch, Awaiting.DECISION, announce=False)
        self._ask(
            EpochReport(
                epoch=epoch,
                train_loss_sum=float(train.total),
                train_count=int(train.count),
                valid_loss_sum=float(valid.total),
                valid_count=int(valid.count),
                train_metrics=wire_metrics("train", train),
                valid_metrics=wire_metrics("validation", valid),
                # the next epoch's counts, so that the decision can carry its Go
                ready=(
                    _ready(epoch + 1, batches, valid_epoch, self.generation, rejoin)
                    if epoch + 1 < self.epochs
                    else None
                ),
                checksum=self._checksum(),
                generation=self.generation,
                lr=self._rate(),
            )
        )
        faults.hit("epoch-end", rank=self.rank, epoch=epoch)
        decision: Decision = self._expect(Decision)
        self._decided = decision.epoch
        if not decision.stop:  # after a stop it waits for the finish: the report says where
            self._asked = None
        record = EpochRecord(
            epoch=decision.epoch,
            train_loss=decision.train_loss,
            valid_loss=decision.valid_loss,
            smoothed_loss=decision.smoothed_loss,
            lr_factor=go.lr_factor,
            seconds=time.monotonic() - started,
            metrics=metric_values(decision),
        )
        curve.append(record)
        if decision.is_best and on_best is not None:
            on_best(decision.epoch)
        if decision.checkpoint and state is not None:
            self.client.at(Phase.CHECKPOINT, epoch)
            self._save(decision.epoch, state, curve)
        if decision.gather:  # newcomers join before the next epoch: the state onto rank 0 first
            self._gather(decision.epoch + 1, rejoin)
        return decision

    def _gather(self, epoch: int, rejoin: Rejoin | None) -> None:
        """Collective in this world, as a decision asks: this rank's part of the state ``epoch``
        starts from, onto rank 0, for the newcomers that join before it; the epoch is then
        announced with a ready (nobody trains it in this world)."""
        if rejoin is None or rejoin.gather is None:
            raise EpochalError(
                "the coordinator asked this rank to gather its state for newcomers, but its "
                "training loop cannot (its readies did not say it can): the worker and the "
                "coordinator are out of step (mixed epochal versions?)"
            )
        self.client.at(Phase.CHECKPOINT, epoch - 1)
        rejoin.gather(epoch)

    def _rate(self) -> float | None:
        """The optimizer's learning rate for the epoch report; None when not known or not a
        finite number (a scheduler's tensor rate is read as a number)."""
        if self._learning_rate is None:
            return None
        rate = float(self._learning_rate())
        return rate if math.isfinite(rate) else None

    def _checksum(self) -> int | None:
        """This rank's weights' checksum for its epoch report, when the run compares them."""
        if not self._replica_check or self.model is None:
            return None
        return weights_checksum(self.model)

    def _ask(self, message: EpochReady | EpochReport) -> None:
        """Send ``message``, whose answer this rank now awaits."""
        self._asked = message
        self.client.send(message)

    def _send_again(self) -> list[str]:
        """A restarted coordinator took this rank back where it is: send again what it awaits
        an answer to, and (rank 0) its last checkpoint's commit; what was sent, for the log."""
        sent = []
        if self._saved is not None:
            self.client.send(Checkpointed(epoch=self._saved))
            sent.append(f"the commit of the checkpoint of epoch {self._saved}")
        asked = self._asked
        if asked is not None:
            self.client.send(asked)
            what = "report" if isinstance(asked, EpochReport) else "ready"
            sent.append(f"its {what} of epoch {asked.epoch}")
        return sent

    def fail(self, exc: BaseException) -> None:
        """Tell the coordinator this rank cannot go on, so every other rank stops too."""
        self.client.send(Failed(reason=clip(failure_reason(exc))))

    def _expect(self, *kinds: type[Any]) -> Any:
        while True:
            try:
                message = self.client.receive()
            except CoordinatorLost as lost:
                message = self._reattach(lost, kinds)
            decided = self._decided
            if (
                isinstance(message, Decision)
                and Decision not in kinds
                and decided is not None
                and message.epoch <= decided
            ):
                continue  # sent again by a restarted coordinator that took this rank back
            if isinstance(message, kinds):
                return message
            if isinstance(message, Regroup):
                if message.generation > self.generation:
                    raise RegroupNow(message)
                continue  # taken already (between two batches)
            if isinstance(message, Welcome | Joined):
                continue  # an answer to a retried hello
            expected = " or ".join(k.__name__ for k in kinds)
            raise EpochalError(
                f"expected {expected} from the coordinator, got {type(message).__name__}: "
                "the worker and the coordinator are out of step (mixed epochal versions?)"
            )

    def close(self, *, finished: bool = True) -> None:
        """Leave the process group and stop the control client. Safe to call twice.

        A session that never ran :meth:`run_epochs` belongs to a script with a loop of its own,
        which used :func:`~epochal.worker.join.join` for the rendezvous and the process group
        only: closing it ``finished`` (the ``with`` block ended without an exception) tells the
        coordinator this rank is done and waits, at most the run's heartbeat timeout, for the
        run's Finish; the run is finished once every rank has closed. RunAborted when the run was
        aborted meanwhile (another rank failed).
        """
        if self._closed:
            return
        self._closed = True
        ended = False  # every rank finished: no collective of this rank's can be left running
        try:
            if finished and not self._ran_epochs:
                finish_without_epochs(self.client, self.rank, self.start_epoch)
            ended = finished
        finally:
            self._teardown(finished=ended)

    def _teardown(self, *, finished: bool) -> None:
        if dist.is_initialized():
            try:
                if finished:
                    close_group()  # its threads end now, not while the interpreter exits
                else:
                    dist.destroy_process_group()
            except Exception:  # tearing down after an abort: the peers may be gone already
                pass
        self.client.close(finished=finished)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(finished=kind is None)


def _ready(
    epoch: int,
    batches: tuple[int, int | None] | Callable[[int], tuple[int, int | None]],
    valid_epoch: Callable[[EpochContext], LossSum] | None,
    generation: int,
    rejoin: Rejoin | None,
) -> EpochReady:
    """This rank's batch counts for ``epoch`` in world ``generation`` (valid None: it has no
    validation function), what its copy of the epoch's start holds and whether it gathers its
    state for newcomers (``rejoin``: how its training loop follows a change of world)."""
    train_batches, valid_batches = batches(epoch) if callable(batches) else batches
    return EpochReady(
        epoch,
        train_batches,
        None if valid_epoch is None else valid_batches,
        generation,
        snapshots=(SnapshotScope.WHOLE if rejoin is None else rejoin.scope).value,
        gathers=rejoin is not None and rejoin.gather is not None,
    )
