"""Checkpoints against another local user, for real: ``epochal run`` with two workers.

A forger who can write the files but lacks the key: a rank file or DCP's ``.metadata`` swapped
for a pickle that would create a marker file when loaded, with the manifest's SHA-256 recomputed
(the attack that ran a command as the victim before manifests were signed). The resume must never
create the marker, must name the manifest it refuses, fall back to the previous checkpoint and
finish. A checkpoint directory that ``nobody`` created is refused before any worker starts; a
written checkpoint is closed to ``nobody``, whatever the umask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from tests.forgery import forge
from tests.integration.conftest import SCRIPTS, Spawner
from tests.security.other_user import as_other_user, needs_root, shared_scratch

pytestmark = pytest.mark.slow

EPOCHS = 5
DEADLINE = 120.0
FAIL_IN_EPOCH_3 = "raise@train-step:rank=1:epoch=3:step=2"
"""The first run fails here, after the checkpoints of epochs 0, 1 and 2 were committed."""


def launch(spawn: Spawner, run_dir: Path, out: Path, *extra: str, **env: str):
    return spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        str(EPOCHS),
        "--run-dir",
        str(run_dir),
        *extra,
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(out),
        **env,
    )


@pytest.mark.parametrize("victim", ["rank00001.pt", ".metadata"])
def test_a_forged_checkpoint_never_runs_and_the_resume_falls_back(
    spawn: Spawner, tmp_path: Path, victim: str
) -> None:
    run_dir, out, marker = tmp_path / "run", tmp_path / "out", tmp_path / "forged-code-ran"
    code, output = spawn.finish(
        launch(spawn, run_dir, out, EPOCHAL_FAULT=FAIL_IN_EPOCH_3), DEADLINE
    )
    assert code == 1, output
    latest = run_dir / "checkpoints" / "epoch-000002"
    forge(latest, victim, marker)

    code, output = spawn.finish(launch(spawn, run_dir, out), DEADLINE)
    assert not marker.exists(), "the forged pickle was loaded"
    assert code == 0, output
    assert f"the checkpoint of epoch 2 is unusable: {latest / 'MANIFEST.json'} does not verify" in (
        output
    )
    assert "falling back to the previous one" in output
    assert "from the checkpoint of epoch 1" in output
    for rank in (0, 1):
        result = torch.load(out / f"rank{rank}.pt")
        assert [r[0] for r in result["curve"]] == list(range(EPOCHS))  # the run finished
    spawn.assert_none_left()


@needs_root
def test_a_checkpoint_directory_another_user_made_is_refused_before_any_worker_starts(
    spawn: Spawner, tmp_path: Path
) -> None:
    with shared_scratch() as shared:
        planted = shared / "ckpt"
        as_other_user(["mkdir", "-m", "755", str(planted)])
        proc = launch(spawn, tmp_path / "run", tmp_path / "out", "--checkpoint-dir", str(planted))
        code, output = spawn.finish(proc, DEADLINE)
        assert code == 2, output
        lines = [
            line for line in output.splitlines() if "refusing the checkpoint directory" in line
        ]
        assert len(lines) == 1, output
        assert f"{planted} belongs to another user (uid 65534" in lines[0]
        assert "Traceback" not in output and "starting 2 workers" not in output
        assert list(planted.iterdir()) == []
    spawn.assert_none_left()


@needs_root
def test_a_written_checkpoint_is_closed_to_other_users_whatever_the_umask(
    spawn: Spawner, tmp_path: Path
) -> None:
    with shared_scratch() as shared:
        checkpoints = shared / "ckpt"
        old = os.umask(0)  # inherited by the run: DCP writes its files with it
        try:
            proc = launch(
                spawn, tmp_path / "run", tmp_path / "out", "--checkpoint-dir", str(checkpoints)
            )
        finally:
            os.umask(old)
        code, output = spawn.finish(proc, DEADLINE)
        assert code == 0, output
        found = list(checkpoints.rglob("*"))
        assert [p for p in found if p.name == "MANIFEST.json"], output
        assert stat.S_IMODE(checkpoints.stat().st_mode) == 0o700
        for path in found:
            mode = stat.S_IMODE(path.lstat().st_mode)
            assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
        one = next(p for p in found if p.name == "MANIFEST.json")
        for command in (["ls", str(checkpoints)], ["touch", str(one.parent / "planted")]):
            tried = as_other_user(command, check=False)
            assert tried.returncode != 0 and "Permission denied" in tried.stderr, tried
    spawn.assert_none_left()
