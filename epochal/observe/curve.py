"""Draw RUN_DIR/curve.png when a run ends (see :func:`epochal.plot.write_curve`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epochal.observe.base import RunObserver, RunStart


class Curve(RunObserver):
    """Writes the learning curve at the end of every attempt of the run; never fails it."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir

    def on_start(self, start: RunStart) -> None:
        if start.run_dir is not None:
            self.run_dir = start.run_dir

    def on_end(self, result: Mapping[str, Any]) -> None:
        from epochal.plot import write_curve  # matplotlib only now, never at import

        write_curve(self.run_dir)
