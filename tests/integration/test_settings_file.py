"""A real run set by the epochal.toml beside its script; tests/test_configfile.py has the rest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, Spawner

pytestmark = pytest.mark.slow

DEADLINE = 300.0
"""Two epochs of the digits example; only a hang should reach this."""


def test_a_run_trains_for_the_epochs_of_epochal_toml_beside_the_script(
    spawn: Spawner, tmp_path: Path
):
    shutil.copy(REPO / "examples" / "digits.py", tmp_path / "digits.py")
    (tmp_path / "epochal.toml").write_text("# the digits example, briefly\nepochs = 2\n")
    run_dir = tmp_path / "run"
    proc = spawn.epochal("run", "--nproc", "2", "--run-dir", str(run_dir), "digits.py")
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    assert "epochal: settings from epochal.toml" in output
    assert "best epoch" in output and " of 2:" in output, output
    assert json.loads((run_dir / "run.json").read_text())["config"]["epochs"] == 2
    epochs = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    assert max(e["epoch"] for e in epochs if "epoch" in e) == 1  # epochs 0 and 1
