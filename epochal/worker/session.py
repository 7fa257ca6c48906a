"""Following the coordinator's epochs: the worker API's lower level.

A :class:`Session` is one worker's membership in a run (:func:`~epochal.worker.join.join`
makes it). :meth:`Session.run_epochs` is lamp's ``epochs`` loop with the decisions taken by the
coordinator: the user supplies a train-epoch function and a validation function; the session
announces batch counts, waits for Go, runs them, reports the loss sums and follows the Decision.
One exchange lies between two trainings: each loss report carries this rank's batch counts for
the next epoch, and each decision that does not stop the run carries the next epoch's Go. Only
the first epoch of a run (or of a resume) is announced on its own (``epoch_ready`` -> ``go``).

The session is a thin owner: what it knows of the run is one
:class:`~epochal.worker.sessionparts.standing.Standing`, and each concern is a part it holds and
calls (:mod:`epochal.worker.sessionparts`): the exchange with the coordinator, checkpoints,
re-attaching to a restarted coordinator, a new world after a lost rank.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from epochal.errors import CoordinatorLost, EpochalError, RunAborted
from epochal.protocol import (
    Awaiting,
    Decision,
    Done,
    EpochReport,
    Failed,
    Finish,
    Go,
    Hello,
    Phase,
    Regroup,
    Restore,
    StepRates,
    Welcome,
    clip,
)
from epochal.worker import faults
from epochal.worker.checkpoints.checkpoint import Checkpointer
from epochal.worker.checkpoints.state import Stateful
from epochal.worker.control.admission import StoreRef
from epochal.worker.control.client import ControlClient, RegroupNow
from epochal.worker.control.exits import failure_reason
from epochal.worker.control.finish import finish_without_epochs
from epochal.worker.control.progress import CpuProgress, thread_cpu
from epochal.worker.control.worlds import Rejoin
from epochal.worker.dataplane.sockets import GroupSockets
from epochal.worker.regroup.leave import close_group
from epochal.worker.sessionparts.course import Batches, Course, PassShape, Training
from epochal.worker.sessionparts.exchange import Exchange
from epochal.worker.sessionparts.reattach import KeptWhereItWas, Reattach, TakenBack
from epochal.worker.sessionparts.savepoints import Savepoints
from epochal.worker.sessionparts.standing import Standing
from epochal.worker.sessionparts.worldchange import WorldChange
from epochal.worker.training.checksums import weights_checksum
from epochal.worker.training.results import (
    EpochContext,
    EpochRecord,
    LossSum,
    RunResult,
    metric_values,
    wire_metrics,
)

__all__ = ["EpochContext", "EpochRecord", "LossSum", "Rejoin", "RunResult", "Session"]


class Session:
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
        self.model = model
        # the model whose weights the ranks compare after each epoch (join's); None: none
        self.device = device
        standing = Standing.welcomed(welcome, store)
        self._standing = standing
        self._exchange = Exchange(client, standing)
        self._savepoints = Savepoints(standing, self._exchange.committed)
        self._reattach = Reattach(
            client,
            standing,
            hello=hello,
            endpoint=endpoint,
            timeout=reattach_timeout,
            store_timeout=store_timeout,
        )
        self._world = WorldChange(
            client,
            standing,
            device,
            sockets=sockets if sockets is not None else GroupSockets({}),
            endpoint=endpoint,
            store_timeout=store_timeout,
        )
        self._closed = False
        self._learning_rate: Callable[[], float] | None = None
        self._ran_epochs = False  # run_epochs was called: this run's epochs are epochal's
        client.busy = CpuProgress(thread_cpu(threading.get_ident()))
        # until run_epochs: a loop of the script's own, whose progress is the CPU it uses
        client.rank = standing.rank
        client.on_regroup = self._world.leave_now  # see WorldChange.leave_now

    # ------------------------------------------------------------------ what it knows

    @property
    def rank(self) -> int:
        """This rank, in the world it is in now."""
        return self._standing.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the world this rank is in now."""
        return self._standing.world_size

    @property
    def backend(self) -> str:
        """The process group's backend (gloo, nccl)."""
        return self._standing.backend

    @property
    def run_id(self) -> str:
        """The run's id, as the coordinator that runs it now says it."""
        return self._standing.run_id

    @property
    def generation(self) -> int:
        """The world's number: 0 for the run's first, one more for each change."""
        return self._standing.generation

    @property
    def restore(self) -> str:
        """How this world's members take the state of :attr:`start_epoch` (a Restore)."""
        return self._standing.restore

    @property
    def elastic(self) -> bool:
        """The run goes on without a lost rank (``--min-workers``)."""
        return self._standing.elastic

    @property
    def start_epoch(self) -> int:
        """The epoch this world (or the resumed run) starts at."""
        return self._standing.start_epoch

    @property
    def epochs(self) -> int:
        """The run's number of epochs at most."""
        return self._standing.epochs

    @property
    def steps_per_epoch(self) -> int | None:
        """An epoch's global optimizer steps (``--steps-per-epoch``); None: one pass."""
        return self._standing.steps_per_epoch

    @property
    def lr_steps(self) -> StepRates | None:
        """The per-step learning-rate schedule to apply; None: each go's factor holds."""
        return self._standing.lr_steps

    @property
    def resume_epoch(self) -> int | None:
        """The epoch whose checkpoint the run resumes from; None: a fresh start."""
        return self._standing.resume_epoch

    @property
    def checkpointer(self) -> Checkpointer | None:
        """This rank's checkpoints of the run; None: the run keeps none."""
        return self._standing.checkpointer

    # ------------------------------------------------------------------ the loop

    def run_epochs(
        self,
        train_epoch: Callable[[EpochContext], LossSum],
        valid_epoch: Callable[[EpochContext], LossSum] | None = None,
        *,
        batches: Batches,
        on_best: Callable[[int], None] | None = None,
        state: Stateful | None = None,
        rejoin: Rejoin | None = None,
        learning_rate: Callable[[], float] | None = None,
        passes: PassShape | None = None,
    ) -> RunResult:
        """Run epochs until the coordinator says stop, then wait for Finish.

        ``batches`` is ``(train_batches, valid_batches)`` this rank holds (``valid_batches`` None
        when it has no validation data), or a function of the epoch returning that; the function
        is asked for an epoch's counts before it starts (for every epoch but the first, when the
        previous epoch's loss report is sent, which carries them), never for an epoch past the
        run's last. The functions receive an :class:`EpochContext` and must run exactly
        ``ctx.train_batches`` / ``ctx.valid_batches`` batches, returning the summed loss and the
        sample count.
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
        shows the coordinator's factor (``lr x1``). ``passes()`` is the training data's (global
        batches of a pass, samples of a global batch), for the journal's data position.
        """
        training = Training(train_epoch, valid_epoch, batches, on_best, rejoin, passes)
        self._learning_rate = learning_rate
        self._ran_epochs = True
        self.client.busy = None  # from here on the epochs' steps say the progress
        course = Course(self.start_epoch, state)
        try:
            course.curve = self._savepoints.resume(state)
            finish = self._follow(training, course)
            self.client.send(Done())
        except (RunAborted, KeyboardInterrupt):
            self._savepoints.drain()  # no writer outlives the run; this is what it reports
            raise
        except BaseException as exc:
            self._savepoints.drain()  # no writer outlives the run; exc is what it reports
            self.fail(exc)
            if (word := self._exchange.word_on(exc)) is not None:  # a lost peer: say its cause
                raise word from exc
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
            curve=course.curve,
        )

    def _follow(self, training: Training, course: Course) -> Finish:
        """Follow the coordinator's epochs from ``course`` until its Finish: each epoch decided,
        a restarted coordinator's resume, a new world after a lost rank."""
        while True:
            error: BaseException | None
            try:
                outcome = self._next(training, course)
            except TakenBack:  # by a restarted coordinator: go on from its checkpoint
                self._savepoints.resume(course.state)
                course.restart(self.start_epoch)
                continue
            except RegroupNow as now:
                regroup, error = now.regroup, now
            except (RunAborted, KeyboardInterrupt, CoordinatorLost):
                raise
            except Exception as exc:
                if not self.elastic or training.rejoin is None:
                    raise
                regroup, error = self._world.broken(course.epoch, exc), exc
            else:
                if isinstance(outcome, Finish):
                    return outcome
                course.advance(outcome)
                continue
            # outside the handler, which holds the old group
            self._regroup(regroup, training.rejoin, error, course)
            error = None  # its frames may hold the old group

    def _next(self, training: Training, course: Course) -> Decision | Finish:
        """The next step of the run: the Finish once the last epoch is decided, else the next
        epoch run and decided (or the Finish of a resumed run that had already stopped)."""
        if course.stopped:  # after the last epoch decided, not in one past it
            self._savepoints.settle()  # the last checkpoint written before the run ends
            self.client.at(Phase.FINISHING, course.epoch - 1)
            finish: Finish = self._expect(Finish)
            return finish
        go = course.go if course.go is not None else self._announce(training, course.epoch)
        if isinstance(go, Finish):
            return go
        started = time.monotonic()
        train, valid = self._train(training, course.epoch, go)
        decision = self._report(training, course.epoch, train, valid)
        self._conclude(training, course, go, decision, time.monotonic() - started)
        return decision

    def _announce(self, training: Training, epoch: int) -> Go | Finish:
        """Announce the first epoch of a run or a resume: its Go, or a stopped run's Finish."""
        self.client.at(Phase.WAITING, epoch, Awaiting.GO, announce=False)  # the ready says it
        self._exchange.ask(training.ready(epoch, self.generation))
        answer: Go | Finish = self._expect(Go, Finish)
        self._exchange.answered()
        return answer

    def _train(self, training: Training, epoch: int, go: Go) -> tuple[LossSum, LossSum]:
        """Run ``epoch`` as its ``go`` says: the training code's train and validation; their loss
        sums."""
        ctx = training.context(go, self)
        self.client.at(Phase.TRAIN, epoch, announce=False)  # the Go said it: one frame fewer
        train = training.train_epoch(ctx)
        valid = LossSum(0.0, 0)
        if training.valid_epoch is not None and go.valid_batches > 0:
            self.client.at(Phase.VALIDATE, epoch, announce=False)  # the next heartbeat says it
            valid = training.valid_epoch(ctx)
        return train, valid

    def _report(self, training: Training, epoch: int, train: LossSum, valid: LossSum) -> Decision:
        """Report ``epoch``'s losses, with the next epoch's counts; the coordinator's Decision."""
        self.client.at(Phase.WAITING, epoch, Awaiting.DECISION, announce=False)  # said by it
        self._exchange.ask(
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
                    training.ready(epoch + 1, self.generation) if epoch + 1 < self.epochs else None
                ),
                checksum=self._checksum(),
                generation=self.generation,
                lr=self._rate(),
            )
        )
        faults.hit("epoch-end", rank=self.rank, epoch=epoch)
        decision: Decision = self._expect(Decision)
        self._exchange.decided(decision)
        return decision

    def _conclude(
        self, training: Training, course: Course, go: Go, decision: Decision, seconds: float
    ) -> None:
        """Follow ``decision``. The decided epoch joins the curve (and ``on_best`` keeps it)
        before the checkpoint the decision may ask for: a change of world that breaks the
        checkpoint's collectives keeps what was decided. The previous epoch's checkpoint, written
        meanwhile, is settled first: its writer joined, its error raised."""
        self._savepoints.settle()
        course.curve.append(
            EpochRecord(
                epoch=decision.epoch,
                train_loss=decision.train_loss,
                valid_loss=decision.valid_loss,
                smoothed_loss=decision.smoothed_loss,
                lr_factor=go.lr_factor,
                seconds=seconds,
                metrics=metric_values(decision),
            )
        )
        if decision.is_best and training.on_best is not None:
            training.on_best(decision.epoch)
        if decision.checkpoint and course.state is not None:
            self.client.at(Phase.CHECKPOINT, course.epoch)
            self._savepoints.save(decision.epoch, course.state, course.curve)
        if decision.gather:  # newcomers join before the next epoch: the state onto rank 0 first
            self._gather(decision.epoch + 1, training.rejoin)

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

    def _regroup(
        self,
        regroup: Regroup,
        rejoin: Rejoin | None,
        error: BaseException | None,
        course: Course,
    ) -> None:
        """Leave the broken world (``error``: what broke the epoch), meet the next, rebuild over
        it and restore the start of the epoch it redoes; ``course`` goes on from there, with the
        state the rebuild returned (if any). A checkpoint written in the background is
        settled first: every rank's part of it was written before the epoch that broke."""
        self._savepoints.settle()
        moved = self._world.move(regroup, rejoin, error)
        state = moved.state if moved.state is not None else course.state
        if moved.welcome.restore == Restore.CHECKPOINT:
            assert moved.welcome.resume_epoch is not None  # the coordinator's rule (Welcome)
            self._savepoints.load_for_world(moved.welcome.resume_epoch, moved.state)
        self._world.arrived(moved)
        course.state = state
        course.restart(moved.welcome.start_epoch)

    def _rate(self) -> float | None:
        """The optimizer's learning rate for the epoch report; None when not known or not a
        finite number (a scheduler's tensor rate is read as a number)."""
        rate = math.nan if self._learning_rate is None else float(self._learning_rate())
        return rate if math.isfinite(rate) else None

    def _checksum(self) -> int | None:
        """This rank's weights' checksum for its epoch report, when the run compares them."""
        if not self._standing.replica_check or self.model is None:
            return None
        return weights_checksum(self.model)

    def _expect(self, *kinds: type[Any]) -> Any:
        """The next message that is one of ``kinds``, re-attaching when the coordinator is lost
        meanwhile (see :meth:`Exchange.sort` for what is skipped)."""
        while True:
            try:
                message = self.client.receive()
            except CoordinatorLost as lost:
                message = self._reattach.reattach(lost, kinds)  # TakenBack: resume
                if isinstance(message, KeptWhereItWas):
                    self._reattach.said_again(self._exchange.say_again())
                    continue  # the answer awaited comes from the restarted coordinator
            answer = self._exchange.sort(message, kinds)
            if answer is not None:
                return answer

    # ------------------------------------------------------------------ checkpoints, the end

    def load_checkpoint(self, epoch: int, state: Stateful) -> None:
        """Collective: load ``epoch``'s committed checkpoint into ``state`` (RNGs untouched).

        Raises :class:`~epochal.worker.checkpoints.checkpoint.CheckpointCorrupt` (nothing loaded)
        when the checkpoint does not match its manifest.
        """
        self._savepoints.load(epoch, state)

    def restore_best(self, result: RunResult, state: Stateful) -> RunResult:
        """Collective: load the best epoch's checkpoint into ``state`` at the end of the run.

        A damaged checkpoint is never loaded: ``state`` keeps the last epoch's weights, and the
        returned result says so in ``weights_note`` (also printed), rather than claiming the best.
        """
        return self._savepoints.restore_best(result, state)

    def fail(self, exc: BaseException) -> None:
        """Tell the coordinator this rank cannot go on, so every other rank stops too."""
        self.client.send(Failed(reason=clip(failure_reason(exc))))

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
