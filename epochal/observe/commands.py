"""The ``epochal plot`` and ``epochal status`` commands: a run directory read from outside.

Both read only the files a run writes (run.json, the journal, status.json, result.json), so they
work on a finished run, on one still going and from another machine sharing the directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from epochal.cli.argtypes import seconds
from epochal.errors import ConfigError


def add_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``plot`` and ``status`` to the command line's ``subparsers``; each sets ``handler``."""
    add_plot_command(subparsers)
    add_status_command(subparsers)


def add_plot_command(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "plot",
        help="draw a run's learning curve as a PNG",
        description="Draw the learning curve of the run in RUN_DIR from its journal: train, "
        "validation and smoothed loss, further metrics, the learning-rate factor, the best "
        "epoch and restarts. Works on a finished run and on one still going. Needs matplotlib "
        "(pip install 'epochal[plot]').",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="the PNG to write (default: RUN_DIR/curve.png)",
    )
    p.set_defaults(handler=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from epochal.observe.plot import plot_run
    from epochal.observe.runfiles import is_run_dir

    if not is_run_dir(args.run_dir):
        raise ConfigError(
            f"{args.run_dir} is not a run directory (no run.json, epochs.jsonl or status.json)"
        )
    print(f"wrote {plot_run(args.run_dir, args.output)}", flush=True)
    return 0


def add_status_command(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "status",
        help="show where a run is (live or finished)",
        description="Print the state of the run in RUN_DIR at a glance: epoch, best epoch, "
        "losses, restarts and where each rank is, from RUN_DIR/status.json while the run goes "
        "on, from result.json and the journal once it ended.",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory")
    p.add_argument(
        "--watch",
        type=seconds,
        nargs="?",
        const=2.0,
        default=None,
        metavar="S",
        help="print it again every S seconds (default: 2) until the run ends",
    )
    p.set_defaults(handler=run_status)


def run_status(args: argparse.Namespace) -> int:
    import time

    from epochal.observe.runfiles import is_run_dir
    from epochal.observe.statusfile import describe, ended

    if not is_run_dir(args.run_dir):
        raise ConfigError(
            f"{args.run_dir} is not a run directory (no run.json, epochs.jsonl or status.json)"
        )
    if args.watch is None:
        print(describe(args.run_dir), flush=True)
        return 0
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            done = ended(args.run_dir)
            print(f"{clear}{describe(args.run_dir)}", flush=True)
            if done:
                return 0
            if not clear:
                print(flush=True)  # a blank line between two views in a log
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
