"""deploy/slurm/epochal.sbatch refuses bad usage with one clear line, before it starts anything.

These run the script with bash and a Slurm-like environment, no cluster: every case fails in the
checks at the top of the script, which need no Slurm command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "epochal.sbatch"


def sbatch_script(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EPOCHAL_", "SLURM_"))}
    base.update(EPOCHAL_PYTHON=sys.executable, PYTHONPATH=str(REPO))
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["train.py"], {}, "submit this script with sbatch, not run it directly"),
        ([], {"SLURM_JOB_ID": "7"}, "usage: sbatch --nodes=N --ntasks-per-node=K epochal.sbatch"),
        (["missing.py"], {"SLURM_JOB_ID": "7"}, "missing.py not found in"),
        (
            ["train.py"],
            {"SLURM_JOB_ID": "7", "EPOCHAL_PYTHON": "no-such-python"},
            "no-such-python not found: set EPOCHAL_PYTHON",
        ),
        (
            ["train.py"],
            {"SLURM_JOB_ID": "7", "EPOCHAL_COORDINATOR_ARGS": "--epochs 3 --world-size 4"},
            "EPOCHAL_COORDINATOR_ARGS sets --world-size: this script sets it",
        ),
    ],
)
def test_bad_usage_is_refused_with_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    (tmp_path / "train.py").write_text("")
    done = sbatch_script(tmp_path, *args, **env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not (tmp_path / ".epochal-slurm").exists()  # nothing was started or written


def test_existing_keys_must_cover_every_task(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "epochal", "keys", "generate", "--workers", "2", str(keys)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        check=True,
        timeout=60,
    )
    done = sbatch_script(
        tmp_path, "train.py", SLURM_JOB_ID="7", SLURM_NTASKS="4", EPOCHAL_KEYS=str(keys)
    )
    assert done.returncode == 2, done.stderr
    assert f"{keys}/workers/worker-3.key_secret is missing" in done.stderr, done.stderr
    assert "epochal keys generate --workers 4 DIR" in done.stderr, done.stderr
