"""A script written for torchrun runs unchanged under ``epochal run``: it makes its own process
group from torchrun's variables and keeps its own loop (``scripts/torchrun_ddp.py``: DDP, a
DistributedSampler, nothing of epochal). The coordinator stands down with one line; the run is
finished when every worker exits 0, and a worker that fails stops the others."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from epochal.launch.plain import PLAIN_LINE
from tests.integration.conftest import SCRIPTS, Spawner

pytestmark = pytest.mark.slow

DEADLINE = 120.0
"""Generous: nothing in these runs times out; only a hang should reach it."""


def test_a_torchrun_script_runs_unchanged_and_trains_as_under_torchrun(
    spawn: Spawner, tmp_path: Path
):
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "torchrun_ddp.py"),
        "--out",
        str(tmp_path / "epochal.pt"),
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    assert output.count(PLAIN_LINE) == 1, output
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2, local rank {rank}" in output, output
        assert f"[rank {rank}] rank {rank}: epoch 2 loss" in output, output
    assert output.rstrip().endswith("done: 2 workers exited 0"), output

    # the same script under torchrun itself: the same weights, bit for bit
    proc = spawn.start(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "torchrun_ddp.py"),
        "--out",
        str(tmp_path / "torchrun.pt"),
    )
    code, reference = spawn.finish(proc, DEADLINE)
    assert code == 0, reference
    ours = torch.load(tmp_path / "epochal.pt", weights_only=True)
    theirs = torch.load(tmp_path / "torchrun.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_a_failing_worker_of_a_torchrun_script_stops_the_others(spawn: Spawner, tmp_path: Path):
    # rank 1 exits 3 once the group is made; rank 0 sleeps 600 s outside any collective
    started = time.monotonic()
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "torchrun_ddp.py"),
        "--out",
        str(tmp_path / "out.pt"),
        "--fail-rank",
        "1",
    )
    code, output = spawn.finish(proc, DEADLINE)  # rank 0 alone would sleep 600 s: stopped
    took = time.monotonic() - started
    spawn.assert_none_left()
    assert code == 1, output
    assert output.count(PLAIN_LINE) == 1, output
    assert "FAILED: worker 1 exited with status 3; the others were stopped" in output, output
    assert not (tmp_path / "out.pt").exists()
    print(f"rank 1 failed; every worker gone and the launcher out {took:.1f} s after the start")


def test_a_script_that_joins_only_for_its_process_group_finishes_when_its_sessions_close(
    spawn: Spawner, tmp_path: Path
):
    # the same script with epochal.join() in place of init_process_group(): the coordinator
    # holds the rendezvous, the script keeps its loop, and the run is finished, not aborted,
    # once every rank has closed its session
    run_dir = tmp_path / "run"
    args = [str(SCRIPTS / "torchrun_ddp.py"), "--out", str(tmp_path / "joined.pt"), "--join"]
    proc = spawn.epochal("run", "--nproc", "2", "--run-dir", str(run_dir), *args)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    assert PLAIN_LINE not in output, output  # not taken for a torchrun script: it said hello
    assert output.count("closed its session without running epochs") == 1, output
    assert "finished: its workers ran their own loop, no epochs here" in output, output
    assert output.rstrip().endswith("done: 2 workers closed their sessions and exited 0"), output
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["epochs_run"]) == ("finished", 0), result
    # the same weights as the script making its own group (its test above: as under torchrun)
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "plain"),
        str(SCRIPTS / "torchrun_ddp.py"),
        "--out",
        str(tmp_path / "plain.pt"),
    )
    code, reference = spawn.finish(proc, DEADLINE)
    assert code == 0, reference
    ours = torch.load(tmp_path / "joined.pt", weights_only=True)
    theirs = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
