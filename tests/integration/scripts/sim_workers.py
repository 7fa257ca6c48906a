"""Simulated workers for the scale test: ``bench/control_plane.py``'s driver, which runs many
workers in one process, each speaking the real protocol (``worker_script``, ``epochal.protocol``'s
messages and codec) over a DEALER socket of its own, without torch.

Runs ``--count`` workers numbered from ``--first`` against ``--endpoint`` until every one has
ended its script or ``--run-timeout`` has passed, then writes to ``--out``, as JSON, what each
worker saw: the instants its script marked (``welcome``, ``go.E``, ``report.E``, ``decision.E``),
the ranks its welcomes gave, how many finish messages it got, and its error if it failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from bench.control_plane import Driver, raise_nofile  # noqa: E402
from epochal.protocol import Finish, Welcome  # noqa: E402


class RecordingDriver(Driver):
    """The bench's driver, noting for each worker the ranks welcomed with and the finishes got."""

    def __init__(self, endpoint: str, first: int, count: int, args: dict[str, Any]) -> None:
        super().__init__(endpoint, first, count, args)
        self.ranks: list[list[int]] = [[] for _ in range(count)]
        self.finishes = [0] * count

    def _deliver(self, k: int, data: bytes) -> None:
        message = self._decode(data)
        if isinstance(message, Welcome):
            self.ranks[k].append(message.rank)
        elif isinstance(message, Finish):
            self.finishes[k] += 1
        super()._deliver(k, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--heartbeat-interval", type=float, required=True)
    parser.add_argument("--train-seconds", type=float, required=True)
    parser.add_argument("--run-timeout", type=float, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    raise_nofile()
    driver = RecordingDriver(
        args.endpoint,
        args.first,
        args.count,
        {
            "heartbeat_interval": args.heartbeat_interval,
            "train_seconds": args.train_seconds,
            "run_timeout": args.run_timeout,
        },
    )
    driver.start()
    driver.run(time.monotonic() + args.run_timeout, threading.Event())
    report = [
        {
            "index": w.index,
            "marks": sorted(w.marks),
            "ranks": driver.ranks[k],
            "finishes": driver.finishes[k],
            "error": driver.errors.get(w.index),
        }
        for k, w in enumerate(driver.workers)
    ]
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(args.out)
    driver.close()


if __name__ == "__main__":
    main()
