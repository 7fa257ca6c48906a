"""The learning curve of a run, drawn from its run directory: ``epochal plot RUN_DIR``.

Train and validation loss per epoch, any further numeric metric the journal records, the
smoothed monitored value and the best epoch, the learning-rate factor on a second axis, and
where the run was restarted or resumed. The smoothed value is drawn with what it smooths: beside
the losses when the run monitors the loss, in the metrics' panel under its name (``smoothed
accuracy``) when ``--monitor`` names a metric (run.json's ``config.monitor``). matplotlib (the
``plot`` extra) is imported only when a curve is drawn, with its non-interactive Agg backend, so
the coordinator does not pay for it otherwise.

Where restarts and resumes come from: ``epochs.jsonl`` does not record them (a resumed run
rewrites it without the epochs that were trained after its checkpoint and lost), and ``run.json``
holds only the latest start's ``resumed_from``. ``status.json`` keeps every start of the run in
its ``events`` (see :mod:`epochal.observe.statusfile`); without it, the latest resume from
``run.json`` is all that is known.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

from epochal.errors import ConfigError
from epochal.log import COORDINATOR
from epochal.observe.runfiles import (
    epoch_records,
    read_records,
    read_result,
    read_run,
    read_status,
)
from epochal.rundir.files import private_dir, write_atomic
from epochal.rundir.paths import CURVE_FILE, DEFAULT_MONITOR, monitor_of
from epochal.text import counted, printable

EXTRA_HINT = "pip install 'epochal[plot]'"

MAX_METRICS = 16
"""Most further metrics drawn (the first by name): a journal with thousands of numeric fields
draws a bounded plot."""

_KNOWN = {
    "epoch",
    "train_loss",
    "valid_loss",
    "smoothed_loss",
    "best_loss",
    "best_epoch",
    "lr_factor",
    "next_lr_factor",
    "lr",  # the initial rate times lr_factor: drawn once, as the factor on the second axis
    "seconds",
    "time",
    "train_batches",
    "valid_batches",
    "world_size",
    "generation",
    "attempt",
}
"""Fields of an epoch record drawn in their own way (or not at all: bookkeeping)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def further_metrics(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Numeric fields beyond the losses and bookkeeping, by name: flat fields of the record and
    the entries of a ``metrics`` object, as (epoch, value) points."""
    found: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        fields = {k: v for k, v in record.items() if k not in _KNOWN and k != "metrics"}
        nested = record.get("metrics")
        if isinstance(nested, dict):
            fields.update({str(k): v for k, v in nested.items()})
        for name, value in fields.items():
            number = _number(value)
            if number is not None:
                found.setdefault(name, []).append((record["epoch"], number))
    return found


def restart_marks(run_dir: Path) -> list[tuple[float, str]]:
    """Where the run started again, as (x between two epochs, label): from status.json's
    events, else the latest resume run.json names. Starts at the same epoch share one mark."""
    marks: list[tuple[float, str]] = []
    status = read_status(run_dir) or {}
    events = status.get("events")
    if isinstance(events, list):
        for event in events:
            if not isinstance(event, dict) or event.get("kind") not in ("restart", "resume"):
                continue
            start = event.get("start_epoch")
            if isinstance(start, int):
                label = "restart" if event["kind"] == "restart" else "resumed"
                marks.append((start - 0.5, label))
    if not marks:
        resumed = (read_run(run_dir) or {}).get("resumed_from")
        if isinstance(resumed, int):
            marks.append((resumed + 0.5, "resumed"))
    merged: dict[float, list[str]] = {}  # a restart that failed again, then a resume: one mark
    for x, label in marks:
        if label not in merged.setdefault(x, []):
            merged[x].append(label)
    return [(x, ", ".join(labels)) for x, labels in merged.items()]


def world_marks(records: list[Any]) -> list[tuple[float, str]]:
    """Where the world changed size (an elastic run lost a rank): (x before the epoch redone,
    "4 -> 3 workers"), from the journal's ``world`` records."""
    marks = []
    for record in records:
        if not isinstance(record, dict) or record.get("kind") != "world":
            continue
        epoch, before, after = record.get("epoch"), record.get("from"), record.get("to")
        if isinstance(epoch, int) and isinstance(before, int) and isinstance(after, int):
            marks.append((epoch - 0.5, f"{before} -> {after} workers"))
    return marks


def _points(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for record in records:
        value = _number(record.get(name))
        if value is not None:
            xs.append(record["epoch"])
            ys.append(value)
    return xs, ys


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(f"drawing a learning curve needs matplotlib: {EXTRA_HINT}") from None
    matplotlib.use("Agg", force=True)
    from matplotlib import pyplot

    return pyplot


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw the learning curve of the run in ``run_dir`` to ``out`` (PNG; default
    RUN_DIR/curve.png) and return where. ConfigError when there is nothing to draw, or when a
    file of ``run_dir`` is not one a run writes (a link, a FIFO, too large).

    The PNG is written as every file of a run is: to a new file under an unguessable name, then
    renamed into place, mode 0600, so a link planted at ``out`` or beside it is never followed.
    Text from the files (the run id, metric names) is drawn as text (no mathtext), escaped."""
    run_dir = Path(run_dir)
    out = run_dir / CURVE_FILE if out is None else Path(out)
    records = epoch_records(read_records(run_dir))
    if not records:
        raise ConfigError(f"{run_dir} has no epoch in its journal (epochs.jsonl) to draw yet")
    plt = _matplotlib()
    with plt.rc_context({"text.parse_math": False}):
        fig = figure(plt, run_dir, records)
        try:
            buffer = io.BytesIO()
            fig.savefig(buffer, dpi=110, format="png")
        finally:
            plt.close(fig)
        png = buffer.getvalue()
    if not os.path.lexists(out.parent):
        private_dir(out.parent, kind="directory for the plot")
    write_atomic(out, png, durable=False)
    return out


def figure(plt: Any, run_dir: Path, records: list[dict[str, Any]]) -> Any:
    """The learning curve as a matplotlib figure (the caller saves and closes it)."""
    from matplotlib.ticker import MaxNLocator

    config = (read_run(run_dir) or {}).get("config")
    config = config if isinstance(config, dict) else {}
    monitor = monitor_of(config)
    extra = further_metrics(records)
    if len(extra) > MAX_METRICS:
        extra = dict(sorted(extra.items())[:MAX_METRICS])
    rows = 2 if extra or monitor != DEFAULT_MONITOR else 1
    fig, axes = plt.subplots(
        rows,
        1,
        figsize=(9, 5.2 if rows == 1 else 7.6),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 1.4][:rows]},
    )
    try:
        ax = axes[0][0]
        _draw_losses(ax, records, smoothed=monitor == DEFAULT_MONITOR)
        lr = ax.twinx()
        xs, ys = _points(records, "lr_factor")
        lr.step(xs, ys, where="mid", color="0.55", linewidth=1.2, label="lr factor")
        lr.set_ylabel("learning-rate factor", color="0.4")
        lr.set_ylim(0, max([*ys, 1.0]) * 1.08)
        lr.tick_params(axis="y", colors="0.4")
        marks = [(x, label, "tab:red") for x, label in restart_marks(run_dir)]
        marks += [(x, label, "tab:purple") for x, label in world_marks(read_records(run_dir))]
        for x, label, color in marks:
            for a in axes[:, 0]:
                a.axvline(x, color=color, linestyle=":", linewidth=1.3)
            ax.annotate(
                label,
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12),
                textcoords="offset points",
                color=color,
                fontsize=8,
            )
        handles, labels = ax.get_legend_handles_labels()
        more, more_labels = lr.get_legend_handles_labels()
        # on the second axis, which is drawn over the first: nothing crosses the legend
        lr.legend(
            handles + more, labels + more_labels, loc="upper right", fontsize=8, framealpha=0.95
        )
        ax.set_title(_title(run_dir, records, config), fontsize=10)
        if rows == 2:
            mx = axes[1][0]
            for name, points in sorted(extra.items()):
                mx.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker=".",
                    label=printable(name, 60),
                )
            if monitor != DEFAULT_MONITOR:
                best = _draw_smoothed(mx, records, f"smoothed {monitor}")
                if best is not None:  # the best epoch's line crosses the losses too
                    ax.axvline(best, color="tab:purple", linestyle="-.", linewidth=1, alpha=0.7)
            mx.set_ylabel("metrics")
            mx.legend(loc="best", fontsize=8)
            mx.grid(alpha=0.3)
        axes[-1][0].set_xlabel("epoch")
        axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


def _draw_losses(ax: Any, records: list[dict[str, Any]], *, smoothed: bool) -> None:
    """The losses; with ``smoothed`` (the run monitors the loss) the smoothed loss and the best
    epoch on it too."""
    shown: list[float] = []
    for name, label, style in (
        ("train_loss", "train loss", {"color": "tab:blue", "linewidth": 1.6}),
        ("valid_loss", "validation loss", {"color": "tab:orange", "marker": "o", "markersize": 3}),
    ):
        xs, ys = _points(records, name)
        if xs:
            ax.plot(xs, ys, label=label, **style)
            shown.extend(ys)
    if smoothed:
        shown.extend(_points(records, "smoothed_loss")[1])
    if shown and min(shown) > 0 and max(shown) / min(shown) >= 10:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
    ax.set_ylabel("loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))
    ax.grid(alpha=0.3)
    if smoothed:
        _draw_smoothed(ax, records, "smoothed loss", fallback="train_loss")


def _draw_smoothed(
    ax: Any, records: list[dict[str, Any]], label: str, fallback: str | None = None
) -> int | None:
    """The smoothed monitored value as ``label``, and the best epoch marked on it (on
    ``fallback``'s value where an epoch has no smoothed value); the best epoch, if any."""
    xs, ys = _points(records, "smoothed_loss")
    if xs:
        ax.plot(xs, ys, label=label, color="tab:green", linestyle="--")
    best = records[-1].get("best_epoch")
    if isinstance(best, int):
        at = next((r for r in records if r["epoch"] == best), None)
        y = None if at is None else _number(at.get("smoothed_loss"))
        if y is None and at is not None and fallback is not None:
            y = _number(at.get(fallback))
        ax.axvline(best, color="tab:purple", linestyle="-.", linewidth=1, alpha=0.7)
        if y is not None:
            ax.plot(
                [best],
                [y],
                marker="*",
                markersize=13,
                color="tab:purple",
                linestyle="none",
                label=f"best epoch {best} ({y:.4g})",
            )
        return best
    return None


def _minor_label(y: float, _: Any) -> str:
    """Label the minor ticks 2 and 5 of a decade of a log axis, not the crowd between."""
    if y <= 0:
        return ""
    mantissa = round(y / 10 ** math.floor(math.log10(y)), 6)
    return f"{y:g}" if mantissa in (2.0, 5.0) else ""


def _title(run_dir: Path, records: list[dict[str, Any]], config: dict[str, Any]) -> str:
    run = read_run(run_dir) or {}
    result = read_result(run_dir) or {}
    run_id = result.get("run_id") or run.get("run_id") or run_dir.name
    status = result.get("status") or "running (or stopped without a result)"
    last = records[-1]
    best = last.get("best_epoch")
    how = "highest" if config.get("monitor_mode") == "max" else "lowest"
    by = f"{how} smoothed {monitor_of(config)}"
    best_text = "" if best is None else f", best epoch {best} ({by})"
    return printable(f"run {run_id}: {status}, {counted(len(records), 'epoch')}{best_text}")


def write_curve(run_dir: Path | None) -> Path | None:
    """Write RUN_DIR/curve.png at the end of a run. Never raises: a run without matplotlib, or
    without any epoch, gets no curve; any other failure is one warning line."""
    if run_dir is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        COORDINATOR.debug(f"no learning curve drawn: matplotlib is not installed ({EXTRA_HINT})")
        return None
    try:
        if not epoch_records(read_records(Path(run_dir))):
            return None
        return plot_run(Path(run_dir))
    except Exception as exc:
        COORDINATOR.warning(
            f"warning: the learning curve {Path(run_dir) / CURVE_FILE} was not drawn: "
            f"{type(exc).__name__}: {exc}"
        )
        return None
