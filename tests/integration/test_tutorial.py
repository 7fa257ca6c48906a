"""The tutorial (docs/tutorial.md), run as written: its scripts, its commands, its four steps.

Each step's commands are taken from the page's bash blocks and its scripts from the python blocks
that open with ``# NAME.py``; the test does what the page tells the reader to do between them
(Ctrl-C after a few epochs, a worker started again) and checks what the page says happens.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, Spawner

pytestmark = pytest.mark.slow

PAGE = REPO / "docs" / "tutorial.md"
DEADLINE = 120.0
"""A step's few seconds of training; only a hang should reach this."""


def step(number: int) -> str:
    """The text of the tutorial's step ``number``, from its heading to the next."""
    text = PAGE.read_text(encoding="utf-8")
    match = re.search(rf"^## {number}\. .*?(?=^## )", text, re.S | re.M)
    assert match is not None, f"the tutorial has no step {number}"
    return match.group(0)


def scripts(text: str) -> dict[str, str]:
    """The python blocks of ``text`` that open with ``# NAME.py``, by name."""
    blocks = re.findall(r"```python\n# (\S+\.py)\n(.*?)```", text, re.S)
    return {name: code for name, code in blocks}


def commands(text: str) -> list[list[str]]:
    """The commands of the bash blocks of ``text``, as words, in order."""
    return [
        shlex.split(line)
        for b in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in b.splitlines()
        if line.strip()
    ]


def write_scripts(tmp: Path, *numbers: int) -> None:
    for number in numbers:
        for name, code in scripts(step(number)).items():
            (tmp / name).write_text(code)


class Watched:
    """A process whose output is read as it comes, so that a test can wait for a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, deadline: float = DEADLINE) -> str:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            found = next((x for x in list(self.lines) if re.search(pattern, x)), None)
            if found is not None:
                return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        pytest.fail(f"no line matching {pattern!r}; the output:\n{self.output}")

    def finish(self, deadline: float = DEADLINE) -> int:
        try:
            code = self.proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"{self.proc.args} hung past {deadline} s; its output:\n{self.output}")
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def start(spawn: Spawner, words: list[str]) -> Watched:
    """``words`` as the reader types them: ``VAR=value ... python SCRIPT`` or ``epochal ...``."""
    env = {}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    program, *args = words
    assert program in ("python", "epochal"), words
    return Watched(
        spawn.epochal(*args, **env) if program == "epochal" else spawn.start(*args, **env)
    )


def test_step_1_the_plain_loop_trains(spawn: Spawner, tmp_path: Path):
    write_scripts(tmp_path, 1)
    (command,) = commands(step(1))
    run = start(spawn, command)
    assert run.finish() == 0, run.output
    assert re.search(r"^epoch 9: valid loss 0\.0\d+$", run.output, re.M), run.output


def test_step_2_two_workers_train_and_save_the_best_weights(spawn: Spawner, tmp_path: Path):
    write_scripts(tmp_path, 2)
    (command,) = commands(step(2))
    run = start(spawn, command)
    assert run.finish() == 0, run.output
    # the lines the page shows, from the same seed: the same epochs and the same result
    shown = re.findall(r"^\[epochal\] (epoch \d+ .*?)  [\d.]+s$", step(2), re.M)
    assert shown, "the tutorial shows no epoch line"
    for line in shown:
        assert line in run.output, f"the tutorial shows {line!r}; the run printed:\n{run.output}"
    assert "finished after 10 epochs: best epoch 7 (smoothed loss 0.0330)" in run.output
    assert (tmp_path / "model.pt").is_file()
    spawn.assert_none_left()


def test_step_3_an_interrupted_run_resumes(spawn: Spawner, tmp_path: Path):
    write_scripts(tmp_path, 2)
    first, again = commands(step(3))
    assert again == [first[0], "run", "--resume", *first[2:]], "step 3 resumes another command"
    run = start(spawn, first)
    run.wait_for(r"\[epochal\] epoch 2 \[")
    os.killpg(run.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
    assert run.finish() == 130, run.output
    # (run here as python -m epochal, the line starts with that)
    said = run.wait_for(r"to resume: .*epochal run --resume --run-dir runs/\w+ ")
    assert said.split("--run-dir ")[1].split()[1:] == first[2:], said
    resumed = start(spawn, again)
    assert resumed.finish() == 0, resumed.output
    assert re.search(r"resuming .* at epoch [1-9]", resumed.output), resumed.output
    assert "finished after 30 epochs" in resumed.output
    spawn.assert_none_left()


def test_step_4_an_elastic_run_loses_a_worker_and_gains_one(spawn: Spawner, tmp_path: Path):
    write_scripts(tmp_path, 2)
    coordinator_command, worker_command = commands(step(4))
    assert "--min-workers" in coordinator_command
    coordinator = start(spawn, coordinator_command)
    workers = [start(spawn, list(worker_command)) for _ in range(2)]
    coordinator.wait_for(r"^epoch 2 \[")
    os.killpg(workers[1].proc.pid, signal.SIGINT)  # Ctrl-C in the third shell
    lost = coordinator.wait_for(r"continuing with 1 worker")
    assert workers[1].finish() != 0, workers[1].output
    again = start(spawn, list(worker_command))
    grown = coordinator.wait_for(r"world of generation \d+ formed: 2 workers train epoch")
    assert coordinator.finish() == 0, coordinator.output
    assert re.search(r"finished after 60 epochs", coordinator.output), coordinator.output
    assert workers[0].finish() == 0 and again.finish() == 0, workers[0].output + again.output
    assert lost in coordinator.output and grown in coordinator.output
    spawn.assert_none_left()
