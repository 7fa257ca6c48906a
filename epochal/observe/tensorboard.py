"""``--tensorboard DIR``: every scalar the journal records, per epoch, as TensorBoard events.

Written with the ``tensorboard`` package's own event writer and protocol buffers (the
``tensorboard`` extra), not torch's: the coordinator never imports torch. One writer per run, in
``DIR/NAME`` where NAME is the run directory's name, so ``tensorboard --logdir DIR`` shows the
runs side by side and a resumed run continues its own curves. Each start of the coordinator writes
TensorBoard's restart marker (a ``SessionLog.START`` event at the epoch it starts from), with which
TensorBoard drops the epochs a resume trains again instead of drawing them twice.

DIR and DIR/NAME are created with mode 0700 and refused when another user could write in them
(:func:`epochal.rundir.files.private_dir`): TensorBoard's writer follows links, so nobody else may
plant one where it writes. DIR is checked when the observer is made, before the run starts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from epochal.errors import ConfigError
from epochal.observe.observer import RunObserver, RunStart, StatusSnapshot
from epochal.rundir.files import private_dir
from epochal.rundir.paths import DEFAULT_MONITOR, monitor_of

EXTRA_HINT = "pip install 'epochal[tensorboard]'"

TAGS = {
    "train_loss": "loss/train",
    "valid_loss": "loss/valid",
    "smoothed_loss": "loss/smoothed",
    "best_loss": "loss/best",
    "best_epoch": "best/epoch",
    "lr_factor": "lr/factor",
    "next_lr_factor": "lr/next_factor",
    "seconds": "time/epoch_seconds",
    "train_batches": "batches/train",
    "valid_batches": "batches/valid",
    "world_size": "world/size",
    "generation": "world/generation",
    "steps": "data/steps_per_epoch",
    "data_pass": "data/pass",
    "data_offset": "data/offset",
    "pass_batches": "data/pass_batches",
    "global_batch": "data/global_batch",
}
"""The tag of each known field; any other numeric field NAME of a record (or entry of its
``metrics`` object) is written as ``metrics/NAME``. With ``--monitor NAME`` (a metric) the
smoothed and best monitored values are that metric's, not the loss's: they are written beside it
as ``metrics/smoothed_NAME`` and ``metrics/best_NAME`` (:func:`monitored_tags`). An elastic run's
change of world shows as a step in ``world/size`` (and ``world/generation``) at the epoch it
redid at the new size."""

_NOT_SCALARS = {"epoch", "time", "kind", "attempt"}


def monitored_tags(monitor: str) -> dict[str, str]:
    """:data:`TAGS`, with the smoothed and best values named after the ``monitor``ed value."""
    if monitor == DEFAULT_MONITOR:
        return TAGS
    return {
        **TAGS,
        "smoothed_loss": f"metrics/smoothed_{monitor}",
        "best_loss": f"metrics/best_{monitor}",
    }


def scalars(
    record: Mapping[str, Any], monitor: str = DEFAULT_MONITOR
) -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number in an epoch record (booleans and None are not), of a
    run that monitors ``monitor``."""
    tags = monitored_tags(monitor)
    fields = {k: v for k, v in record.items() if k not in _NOT_SCALARS and k != "metrics"}
    nested = record.get("metrics")
    if isinstance(nested, Mapping):
        fields.update({f"metrics.{k}": v for k, v in nested.items()})
    for name, value in sorted(fields.items()):
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            continue
        plain = name.removeprefix("metrics.")
        yield tags.get(name, f"metrics/{plain}"), float(value)


class TensorBoard(RunObserver):
    """Writes the run's scalars to ``logdir/NAME`` (see the module's text)."""

    def __init__(self, logdir: Path) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ConfigError(
                f"--tensorboard needs the tensorboard package: {EXTRA_HINT}"
            ) from None
        self._event_pb2: Any = event_pb2
        self._summary_pb2: Any = summary_pb2
        self._writer_class: Any = EventFileWriter
        self.logdir = private_dir(logdir, kind="TensorBoard directory (--tensorboard)")
        self.directory: Path | None = None
        self._writer: Any = None
        self.monitor = DEFAULT_MONITOR

    def on_start(self, start: RunStart) -> None:
        self.monitor = monitor_of(start.config)
        if self._writer is None:
            name = start.run_dir.name if start.run_dir is not None else start.run_id
            self.directory = private_dir(self.logdir / name, kind="TensorBoard directory")
            self._writer = self._writer_class(str(self.directory), flush_secs=10)
        log = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
        self._writer.add_event(
            self._event_pb2.Event(wall_time=time.time(), step=start.start_epoch, session_log=log)
        )
        self._writer.flush()

    def on_epoch(self, record: Mapping[str, Any], status: StatusSnapshot) -> None:
        if record.get("kind") != "epoch" or self._writer is None:
            return
        values = [
            self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
            for tag, value in scalars(record, self.monitor)
        ]
        wall = record.get("time")
        self._writer.add_event(
            self._event_pb2.Event(
                wall_time=float(wall) if isinstance(wall, int | float) else time.time(),
                step=int(record["epoch"]),
                summary=self._summary_pb2.Summary(value=values),
            )
        )
        self._writer.flush()  # an epoch is rare: a live TensorBoard sees it at once

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
