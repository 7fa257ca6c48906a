"""The README's quick start, run as written: its first command trains the digits example."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, Spawner

pytestmark = pytest.mark.slow

DEADLINE = 300.0
"""Twenty epochs of a small classifier; only a hang should reach this."""


def quick_start() -> list[str]:
    """The lines of the README quick start's bash block: the two commands."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the quick start has no bash block"
    lines = block.group(1).splitlines()
    assert len(lines) == 2, f"the quick start is two commands, not {len(lines)}: {lines}"
    return lines


def quick_start_command() -> list[str]:
    """The ``epochal run ...`` part of the first command in the README's quick start."""
    first = quick_start()[0]
    command = first.split("&&")[-1].strip()
    words = shlex.split(command)
    assert words[:2] == ["epochal", "run"], f"the quick start's first command changed: {first}"
    return words[1:]


@pytest.mark.parametrize("extra", ["examples", "test"])
def test_the_quick_start_installs_into_a_virtual_environment_only_what_it_runs(extra: str):
    first, second = quick_start()
    assert first.startswith("python3 -m venv .venv && . .venv/bin/activate && "), first
    installs = first if extra == "examples" else second
    assert f"-e '.[{extra}]'" in installs
    assert "test" not in first, "the first command installs the test tools"


def test_ci_runs_the_readmes_test_command_word_for_word():
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == quick_start()[1]


def test_the_quick_start_runs_as_the_readme_says(spawn: Spawner, tmp_path: Path):
    args = [str(REPO / a) if (REPO / a).is_file() else a for a in quick_start_command()]
    proc = spawn.epochal(*args)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    assert re.search(r"\[rank 0\] best epoch \d+ of 20: .* test accuracy 0\.\d+", output), output
    # the example's accuracy metric is aggregated over both ranks and shown every epoch
    assert re.search(r"epoch 19 \[20/20\] .* valid accuracy 0\.\d{4}  smoothed", output), output
    # the rate the example's optimizer holds (SGD, lr 0.05, no schedule), as its workers say it
    assert re.search(r"epoch 19 \[20/20\] .*  lr 0\.05  best ", output), output
    assert "done: best epoch" in output
    (result,) = (tmp_path / "runs").glob("*/result.json")
    assert json.loads(result.read_text())["status"] == "finished"


def first_real_script() -> tuple[str, list[str], str]:
    """The README's first real script: its code, its ``epochal run`` command and the output
    shown for it."""
    section = (REPO / "README.md").read_text().split("## The first real script", 1)[1]
    section = section.split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    command = re.search(r"```bash\n(.*?)```", section, re.S)
    shown = re.search(r"```\n(.*?)```", section, re.S)
    assert code and command and shown, "the first real script lost a block"
    words = shlex.split(command.group(1))
    assert words[:2] == ["epochal", "run"], words
    return code.group(1), words[1:], shown.group(1)


def test_the_readmes_first_real_script_runs_as_shown(spawn: Spawner, tmp_path: Path):
    code, words, shown = first_real_script()
    script = tmp_path / words[-1]
    script.write_text(code)
    proc = spawn.epochal(*words[:-1], str(script))
    status, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert status == 0, output
    # the lines the README shows, from the same seed: the same epochs and the same result
    for line in shown.splitlines():
        if line.startswith("[epochal] epoch"):  # its seconds vary with the machine
            line = line.rsplit("  ", 1)[0]
        elif line.startswith("[epochal] run "):  # its run id is new
            line = line.split(" finished", 1)[1]
        assert line in output, f"the README shows {line!r}; the run printed:\n{output}"
    assert (tmp_path / "model.pt").is_file()
