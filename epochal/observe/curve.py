"""Draw RUN_DIR/curve.png once the run is over (see :func:`epochal.observe.plot.write_curve`)."""

from __future__ import annotations

from pathlib import Path

from epochal.observe.observer import RunObserver, RunStart


class Curve(RunObserver):
    """Writes the learning curve when the observers are closed, after the run's last attempt;
    never fails the run.

    Not at ``on_end``: the coordinator tells its observers on a thread of their own (never its
    event loop) but waits for them before it reports the run done, and importing matplotlib and
    drawing take a second or two; a run restarted after a failure would also draw it once per
    attempt. Its owner closes the observers after the event loop is gone.
    """

    def __init__(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir
        self._started = False

    def on_start(self, start: RunStart) -> None:
        self._started = True
        if start.run_dir is not None:
            self.run_dir = start.run_dir

    def close(self) -> None:
        if not self._started:
            return  # nothing was run (a usage error, a run that had already finished)
        self._started = False
        from epochal.observe.plot import write_curve  # matplotlib only now, never at import

        write_curve(self.run_dir)
