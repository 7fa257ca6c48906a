"""The linters as tests: ``python -m pytest`` (the README's and CI's one command) also runs
``ruff check``, ``ruff format --check`` and ``mypy`` as pyproject.toml configures them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "tool",
    [
        pytest.param(["ruff", "check", "."], id="ruff-check"),
        pytest.param(["ruff", "format", "--check", "."], id="ruff-format"),
        pytest.param(["mypy"], id="mypy"),
    ],
)
@pytest.mark.timeout(600)  # mypy without a cache on a loaded machine
def test_tool_passes(tool: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *tool], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, (
        f"`{' '.join(tool)}` failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
    )
