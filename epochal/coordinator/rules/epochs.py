"""The epoch loop at the coordinator: each epoch's Go, and its decision once every rank reported.

:class:`Epochs` is the part of :class:`~epochal.coordinator.rules.machine.RunMachine` that plans an
epoch from every rank's batch counts (:mod:`.batches`) and sends its Go, keeps each rank's report
of it, then decides it: the replicas' checksums compared (:mod:`.replicas`), the losses and metrics
summed (:mod:`.sums`), the loop state updated (:mod:`.loop`), the decision journaled before it goes
out with the next epoch's Go. A decision may also stop the run (``finishing``'s finish) or grow the
world with newcomers (``regrouping``). It reads and changes the run's facts in the
:class:`~.machinestate.MachineState` it is given. Pure like the machine.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from epochal.coordinator.rules import ending
from epochal.coordinator.rules.actions import Action, Broadcast, Journal, Log, RunPhase
from epochal.coordinator.rules.batches import (
    BatchCounts,
    EpochPlan,
    PolicyViolation,
    format_ranks,
    plan_epoch,
    resliced,
)
from epochal.coordinator.rules.carry import sent_record
from epochal.coordinator.rules.outcome import EpochOutcome, checkpoint_after, format_epoch_line
from epochal.coordinator.rules.replicas import replicas_differ
from epochal.coordinator.rules.sums import LossSums, MetricSums, aggregate_metrics, metric_values
from epochal.coordinator.rules.sums import aggregate as aggregate_losses
from epochal.protocol import Awaiting, EpochReport, Go

if TYPE_CHECKING:
    from epochal.coordinator.rules.finishing import Finishing
    from epochal.coordinator.rules.machinestate import MachineState
    from epochal.coordinator.rules.regrouping import Regrouping


class Epochs:
    """The epoch loop of a run's machine; see the module docstring."""

    def __init__(self, state: MachineState, regrouping: Regrouping, finishing: Finishing) -> None:
        self._state = state
        self._regrouping = regrouping
        self._finishing = finishing

    def note_report(self, now: float, peer: bytes, rank: int, report: EpochReport) -> None:
        """Keep ``rank``'s report of the epoch under way until every rank's is in."""
        self._state.watchdog.note_waiting(rank, report.epoch, Awaiting.DECISION, now)
        if not self._state.reports:
            self._state.round_started = now
        self._state.reports[rank] = LossSums(
            report.train_loss_sum,
            report.train_count,
            report.valid_loss_sum,
            report.valid_count,
            {m.name: (m.total, m.count) for m in report.train_metrics},
            {m.name: (m.total, m.count) for m in report.valid_metrics},
        )
        self._state.checksums[rank] = report.checksum
        self._state.rates[rank] = report.lr
        if report.ready is not None:
            ready = report.ready
            self._state.next_counts[rank] = BatchCounts.of(ready)
            self._state.copies[peer] = ready

    def start_epoch(self, now: float) -> list[Action]:
        """Every rank's epoch_ready is in (the first epoch of a run, of a resume or of a new
        world): its Go. Of an epoch whose start the members gathered for newcomers: the world
        grows instead (unless they left meanwhile), and its readies bring the Go."""
        if self._state.gathering == self._state.epoch:
            self._state.gathering = None
            grown = self._regrouping.grow(now, gathered=True)
            if grown is not None:
                return grown
        formed = self._regrouping.world_formed(now)
        if self._state.loop.history and self._state.loop.history[-1].stop:
            self._state.ready.clear()  # resumed after the last decision: only the finish is left
            return formed + self._finishing.finish(now)
        try:
            go, notes = self._go(self._state.epoch, self._state.ready)
        except PolicyViolation as exc:
            return formed + self._state.abort(f"epoch {self._state.epoch}: {exc}", needs_fix=True)
        self._state.ready.clear()
        self.run(now)
        record = {  # a restarted coordinator answers a rank that missed it with the same go
            "kind": "go",
            "epoch": self._state.epoch,
            "sent": sent_record(go),
            "validates": self._state.validates,
            "world_size": len(self._state.members),
            "generation": self._state.generation,
        }
        return [*formed, *notes, Journal("epoch", record), Broadcast(self._state.recipients(), go)]

    def _go(self, epoch: int, counts: dict[int, BatchCounts]) -> tuple[Go, list[Action]]:
        """Plan ``epoch`` from every rank's batch ``counts`` (or raise PolicyViolation): its Go,
        and the line to log when it reads the rest of a pass in other global batches."""
        plan = plan_epoch(counts, self._state.config.batch_policy)
        note = resliced(self._state.plan, plan, epoch)
        self._state.validates = plan.valid_batches > 0  # every rank has validation data
        validate_now = self._state.validates and self._state.config.validates(epoch)
        self._state.plan = EpochPlan(
            plan.train_batches,
            plan.valid_batches if validate_now else 0,
            plan.pass_batches,
            plan.global_batch,
        )
        go = Go(
            epoch=epoch,
            train_batches=self._state.plan.train_batches,
            valid_batches=self._state.plan.valid_batches,
            lr_factor=self._state.loop.lr_factor,
        )
        return go, [] if note is None else [Log(note)]

    def run(self, now: float) -> None:
        """Epoch ``self._state.epoch`` starts: its Go goes out now."""
        self._state.set_phase(RunPhase.RUNNING, now)
        self._state.epoch_started = now

    def _outcome(self) -> tuple[EpochOutcome, dict[str, MetricSums]] | list[Action]:
        """The epoch under way decided from every rank's report: its outcome and the metrics'
        sums, or the abort when the ranks' weights or reports do not agree."""
        state = self._state
        checksums, state.checksums = state.checksums, {}
        rates, state.rates = state.rates, {}
        rate = next((rates[r] for r in sorted(rates) if rates[r] is not None), None)
        if state.config.replica_check:
            differ = replicas_differ(state.epoch, checksums)
            if differ is not None:  # before the decision: nothing of this epoch is kept
                return state.abort(differ)
        try:
            train_loss, valid_loss = aggregate_losses(state.reports)
            sums = aggregate_metrics(state.reports)
            outcome = state.loop.update(
                state.epoch,
                train_loss,
                valid_loss,
                validates=state.validates,
                metrics=metric_values(sums),
                lr=rate,
            )
        except PolicyViolation as exc:
            return state.abort(f"epoch {state.epoch}: {exc}", needs_fix=True)
        state.reports.clear()
        return outcome, sums

    def decide(self, now: float) -> list[Action]:
        """Every rank's report of the epoch under way is in: its decision, journaled first, and
        with it the next epoch's Go (or the finish, or a world that grows)."""
        state = self._state
        decided = self._outcome()
        if isinstance(decided, list):
            return decided
        outcome, sums = decided
        counts, state.next_counts = state.next_counts, {}
        state.round_seconds = now - state.round_started
        checkpoint = checkpoint_after(state.config, outcome)
        if checkpoint and state.config.elastic:
            state.loops_at[state.epoch] = copy.deepcopy(state.loop)
        seconds = now - state.epoch_started
        plan = state.plan
        assert plan is not None
        record = outcome.record(
            validates=state.validates, checkpoint=checkpoint, plan=plan, seconds=seconds
        )
        record.update(world_size=len(state.members), generation=state.generation)
        position = plan.position(state.epoch, state.config.steps_per_epoch)
        record.update(position)
        actions: list[Action] = [Journal("epoch", record)]
        said = Log(
            format_epoch_line(outcome, state.config.epochs, seconds, state.config.monitor, position)
        )
        if outcome.stop:
            decision = outcome.decision(checkpoint, sums)
            record["next"] = {"sent": sent_record(decision)}
            actions += [Broadcast(state.recipients(), decision), said]
            actions += [Log(line) for line in ending.stop_lines(outcome, state.loop, state.config)]
            return actions + self._finishing.finish(now)
        following = state.epoch + 1
        if len(counts) < len(state.members):
            missing = sorted(set(range(len(state.members))) - set(counts))
            reason = (
                f"{format_ranks(missing)} reported epoch {state.epoch} without its batch counts "
                f"for epoch {following}: the worker and coordinator are out of step (a bug, or "
                "mixed epochal versions)"
            )
            return [*actions, said, *state.abort(reason)]
        gather = self._regrouping.gathers_now()
        try:
            # a world that grows after gathering plans the epoch from the new world's readies
            go, notes = (None, []) if gather else self._go(following, counts)
        except PolicyViolation as exc:  # the decision is journaled; no rank trains that epoch
            return [*actions, said, *state.abort(f"epoch {following}: {exc}", needs_fix=True)]
        decision = outcome.decision(checkpoint, sums, go, gather=gather)
        # kept whole, with the plan of the next epoch: a restarted coordinator answers a rank
        # that missed it with the same decision (the record dict is the Journal action's)
        record["next"] = {"sent": sent_record(decision), "validates": state.validates}
        actions += [Broadcast(state.recipients(), decision), said, *notes]
        state.epoch = following
        if gather:
            # every member gathers its part of the state onto rank 0 in the group it is in,
            # then says epoch_ready (nobody trains): the world grows at those readies
            state.gathering = following
            state.set_phase(RunPhase.READY, now)
            return actions
        grown = self._regrouping.grow(now)
        if grown is not None:
            # newcomers are waiting: the world grows, and the epoch just started begins again in
            # it (each member restores its start, taken before its first step, if it got there)
            return actions + grown
        self.run(now)
        return actions
