"""``epochal run`` as a user meets it: a finished run is reported finished however long the scripts
take to end, torchrun's variables are set, and a script that never joins is told why."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import (
    SCRIPTS,
    Spawner,
    cmdline,
    marked_pids,
    wait_for_record,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DEADLINE = 120.0
"""Generous: the runs below have nothing that times out; only a hang should reach it."""

AFTER = 5.0
"""Seconds of work the script does after epochal.train() returns (more than the old 3-s kill)."""


def test_work_after_training_finishes_and_torchrun_variables_are_set(
    spawn: Spawner, tmp_path: Path
):
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "torchrun_style.py"),
        "--after",
        str(AFTER),
    )
    code, output = spawn.finish(proc, DEADLINE + AFTER)
    spawn.assert_none_left()
    assert code == 0, output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"
    for rank in (0, 1):
        assert (
            f"[rank {rank}] torchrun variables: RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 "
            "LOCAL_WORLD_SIZE=2" in output
        ), output
        assert f"[rank {rank}] rank {rank}: post-training work done" in output, output
    assert "FAILED" not in output and "killed" not in output, output
    assert "done: best epoch" in output


def test_exit_timeout_bounds_the_wait_after_a_finish(spawn: Spawner, tmp_path: Path):
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--exit-timeout",
        "1",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "torchrun_style.py"),
        "--after",
        "600",
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 1, output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"
    assert "the run finished (result.json says so), but workers 0, 1 were still running 1 s " in (
        output
    )
    assert "done:" not in output


def test_a_script_that_never_calls_epochal_is_told_so(spawn: Spawner, tmp_path: Path):
    script = tmp_path / "forgot.py"
    script.write_text("def main():\n    print('training...')\n")
    proc = spawn.epochal("run", "--nproc", "2", "--run-dir", str(tmp_path / "run"), str(script))
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 1, output
    assert "exited with status 0 before the run finished" in output
    assert "did the script call epochal.train() or epochal.join()?" in output


def test_ctrl_c_says_so_once_without_tracebacks(spawn: Spawner, tmp_path: Path):
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "50",
        "--run-dir",
        str(tmp_path / "run"),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
        "--delay",
        "0.05",
        EPOCHAL_PROGRESS="1",  # progress bars too: their fragments must not leak either
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the launcher is alive until it has printed this
        lines.append(line)
        if "epoch 0 [1/50]" in line:
            break
    else:
        pytest.fail("the run ended before its first epoch:\n" + "".join(lines))
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does to the launcher
    code, rest = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    output = "".join(lines) + rest
    after = rest.splitlines()
    assert code == 128 + signal.SIGINT, output
    assert "Traceback" not in output and "GLHF" not in output, output
    assert output.count("SIGINT") == 2, output  # the coordinator's abort, the launcher's last line
    assert len(after) <= 4, output


def custom_loop(spawn: Spawner, tmp_path: Path, *args: str) -> tuple[int, str, Path]:
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(run_dir),
        *args,
        str(SCRIPTS / "custom_loop.py"),
        *(["--plain"] if "plain" in tmp_path.name else []),
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    return code, output, run_dir


def test_a_custom_loop_without_ddp_is_stopped_naming_the_ranks_that_differ(
    spawn: Spawner, tmp_path: Path
):
    plain = tmp_path / "plain"
    plain.mkdir()
    code, output, run_dir = custom_loop(spawn, plain)
    assert code != 0, output
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "aborted"
    assert result["reason"].startswith(
        "after epoch 0 the ranks' weights differ (rank 0 holds one; rank 1 holds another)"
    ), result
    assert "DistributedDataParallel" in result["reason"]
    assert not (run_dir / "epochs.jsonl").read_text().count('"kind": "epoch"'), "decided anyway"
    assert "done after" not in output

    # --no-replica-check: the ranks are meant to differ; the run finishes
    off = tmp_path / "plain-off"
    off.mkdir()
    code, output, run_dir = custom_loop(spawn, off, "--no-replica-check")
    assert code == 0, output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"


def test_a_custom_loop_with_ddp_passes_the_replica_check(spawn: Spawner, tmp_path: Path):
    code, output, run_dir = custom_loop(spawn, tmp_path)
    assert code == 0, output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"
    assert "rank 0: done after 2 epochs" in output and "rank 1: done after 2 epochs" in output


def test_a_killed_preloaded_process_costs_one_restart_and_the_workers_start_afresh(
    spawn: Spawner, tmp_path: Path
):
    """The workers are forked from one process that imported torch (epochal/zygote/); killed,
    it takes them with it: the run restarts from its checkpoint, each worker importing torch
    itself, and finishes."""
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "4",
        "--max-restarts",
        "1",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
        "--delay",
        "0.05",
        EPOCHAL_PRELOAD_SOCKET="",  # a zygote of its own, not the one the session shares
    )
    wait_for_record(run_dir, "epoch", alive=proc)
    title = f"epochal run {proc.pid}:".encode()
    (zygote,) = [pid for pid in marked_pids(spawn.mark) if cmdline(pid).startswith(title)]
    os.kill(zygote, signal.SIGKILL)
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    assert "restart 1 of 1" in output, output
    assert "each worker imports torch itself from now on" in output, output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"


def test_launches_fork_their_workers_from_the_process_epochal_preload_serves(
    spawn: Spawner, tmp_path: Path
):
    """``epochal preload SOCKET`` imports torch once; a launch whose EPOCHAL_PRELOAD_SOCKET names
    it has its workers forked there (their parent), and SIGTERM ends it, its socket removed."""
    path = tmp_path / "preload.sock"
    server = spawn.epochal("preload", str(path), EPOCHAL_PRELOAD_SOCKET="")
    wait_until(
        lambda: path.exists() or server.poll() is not None,
        DEADLINE,
        f"epochal preload neither made {path} nor ended",
    )
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "4",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "resumable.py"),
        "--out",
        str(tmp_path / "out"),
        "--delay",
        "0.05",
        EPOCHAL_PRELOAD_SOCKET=str(path),
    )
    wait_for_record(run_dir, "epoch", alive=proc)
    # a forked worker's command line is one string, its words apart by spaces (setproctitle)
    argvs = {pid: cmdline(pid).replace(b"\0", b" ").split() for pid in marked_pids(spawn.mark)}
    workers = [pid for pid, argv in argvs.items() if argv[2:3] == [bytes(SCRIPTS / "resumable.py")]]
    parents = {cmdline(parent_of(pid)).split(b":")[0] for pid in workers}
    code, output = spawn.finish(proc, DEADLINE)
    assert code == 0, output
    assert len(workers) == 2, argvs
    assert parents == {f"epochal preload {path}".encode()}, parents
    server.send_signal(signal.SIGTERM)
    code, said = spawn.finish(server, DEADLINE)
    assert code == 0, said
    assert said.startswith(
        "epochal: importing torch, torch.distributed, torch._dynamo, torch.distributed.checkpoint "
        "once;"
    ), said
    assert not path.exists()
    spawn.assert_none_left()


def test_a_zygote_that_will_not_fork_is_said_once_and_the_workers_start_afresh(
    spawn: Spawner, tmp_path: Path
):
    """A module EPOCHAL_PRELOAD names starts a thread as it is imported: the preloaded process
    refuses to fork (a fork copies only the caller, not the locks the thread held), the launch
    says why in one line, and its workers start as fresh interpreters."""
    found = tmp_path / "found"
    found.mkdir()
    (found / "starts_a_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    run_dir = tmp_path / "run"
    proc = spawn.epochal(
        "run",
        "--nproc",
        "2",
        "--epochs",
        "2",
        "--run-dir",
        str(run_dir),
        str(SCRIPTS / "torchrun_style.py"),
        EPOCHAL_PRELOAD_SOCKET="",  # a zygote of its own, not the one the session shares
        EPOCHAL_PRELOAD="starts_a_thread",
        PYTHONPATH=os.pathsep.join(p for p in (str(found), os.environ.get("PYTHONPATH")) if p),
    )
    code, output = spawn.finish(proc, DEADLINE)
    spawn.assert_none_left()
    assert code == 0, output
    said = [line for line in output.splitlines() if "could not fork" in line]
    assert said == [
        "[epochal] could not fork a worker: the preloaded process runs 2 threads, and a worker "
        "forked from it would inherit what locks the others held (a module it imported did so: "
        "EPOCHAL_PRELOAD names what it imports): worker 0 and those after it import torch "
        "themselves"
    ], output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "finished"


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return int(stat.read().rsplit(b")", 1)[1].split()[1])
