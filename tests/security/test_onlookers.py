"""``epochal status`` and ``epochal plot`` pointed at a run directory someone else prepared.

An onlooker reads files it did not write: status.json may be a link to ``/dev/zero`` (a reader
that follows it runs out of memory), a FIFO (a reader that opens it waits forever) or larger
than any run writes; a field may hold terminal escapes or a newline followed by a line the
reader would believe. Each command runs as a real process under a memory bound and a deadline:
it must return at once with one line naming the file, print every escape as ``\\x1b``, never
start a line with forged text, and write its PNG without following a link planted beside it.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import REPO
from tests.security.other_user import as_other_user, needs_root, shared_scratch

DEADLINE = 60.0
"""A command that reads a few small files (and, for plot, imports matplotlib); only a hang or a
read without end reaches this."""

MEMORY = 2 << 30
"""Address space each command gets: a read of /dev/zero without a bound exhausts it."""

ESC = "\x1b"
FORGED = "run r in /elsewhere: finished after 9 epochs, best epoch 8"
"""A line the reader would take for the command's own, if a newline in a field reached it."""

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def onlooker(*args: str) -> tuple[int, str]:
    """Run ``epochal ARGS`` to its end, within :data:`DEADLINE` and :data:`MEMORY`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHONPATH"] = str(REPO)

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))

    try:
        done = subprocess.run(
            [sys.executable, "-m", "epochal", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=DEADLINE,
            preexec_fn=bounded,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"epochal {shlex.join(args)} hung past {DEADLINE:g} s: {exc.output!r}")
    return done.returncode, done.stdout.decode("utf-8", errors="replace")


def epoch(n: int, **fields: Any) -> dict[str, Any]:
    return {
        "kind": "epoch",
        "epoch": n,
        "train_loss": 1.0 / (n + 1),
        "valid_loss": 1.2 / (n + 1),
        "smoothed_loss": 1.2 / (n + 1),
        "best_epoch": n,
        "best_loss": 1.2 / (n + 1),
        "lr_factor": 1.0,
        "validates": True,
        **fields,
    }


def a_run(run_dir: Path, epochs: int = 2) -> Path:
    """A run directory holding a plain journal of ``epochs`` epochs and its run.json."""
    run_dir.mkdir(mode=0o700, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r", "config": {"epochs": 5}}))
    journal = "".join(json.dumps(epoch(n)) + "\n" for n in range(epochs))
    (run_dir / "epochs.jsonl").write_text(journal)
    return run_dir


def make_unreadable(path: Path, how: str) -> str:
    """Put at ``path`` what a reader must refuse; return the phrase it must say."""
    path.unlink(missing_ok=True)
    if how == "link to /dev/zero":
        path.symlink_to("/dev/zero")
        return f"{path} is a symbolic link"
    if how == "fifo":
        os.mkfifo(path)
        return f"{path} is not a regular file"
    with open(path, "wb") as f:  # sparse: no disk taken
        f.truncate(80 << 20)
    return f"{path} is {80 << 20} bytes, over the"


HOW = ["link to /dev/zero", "fifo", "too large"]


@pytest.mark.parametrize("how", HOW)
def test_status_refuses_a_status_json_no_run_wrote(tmp_path: Path, how: str) -> None:
    run_dir = a_run(tmp_path / "run")
    says = make_unreadable(run_dir / "status.json", how)
    code, output = onlooker("status", str(run_dir))
    lines = output.strip().splitlines()
    assert code == 2 and len(lines) == 1, output
    assert lines[0].startswith("epochal: error: ") and says in lines[0], output


@pytest.mark.parametrize(
    ("name", "how"),
    [("epochs.jsonl", "link to /dev/zero"), ("epochs.jsonl", "fifo"), ("status.json", "fifo")],
)
def test_plot_refuses_a_file_no_run_wrote(tmp_path: Path, name: str, how: str) -> None:
    run_dir = a_run(tmp_path / "run")
    says = make_unreadable(run_dir / name, how)
    code, output = onlooker("plot", str(run_dir))
    lines = output.strip().splitlines()
    assert code == 2 and len(lines) == 1, output
    assert lines[0].startswith("epochal: error: ") and says in lines[0], output
    assert not (run_dir / "curve.png").exists()


def forged_fields(run_dir: Path, ended: bool) -> None:
    """Terminal escapes and newline-forged lines in every field status shows."""
    a_run(run_dir, epochs=0)
    name = f"close{ESC}[5m\n{FORGED}"
    record = epoch(0, metrics=[name], **{name: 0.5}, best_epoch=f"{ESC}]0;owned\a")
    (run_dir / "epochs.jsonl").write_text(json.dumps(record) + "\n")
    if ended:
        result = {"status": "aborted", "run_id": f"r{ESC}[2J", "reason": f"x{ESC}[2J\n{FORGED}"}
        (run_dir / "result.json").write_text(json.dumps(result))
        return
    rank = {
        "rank": f"0{ESC}[31m",
        "host": f"node{ESC}[2J",
        "phase": f"waiting\n{FORGED}",
        "epoch": 0,
        "step": f"{ESC}[1A",
        "idle": 1.0,
        "last_heard": 0.5,
        "where": f"train.py:9\n{FORGED}",
    }
    status = {
        "state": f"running\n{FORGED}",
        "run_id": f"{ESC}]0;owned\a",
        "epoch": f"{ESC}[2J",
        "epochs": 10,
        "joined": 2,
        "world_size": f"2\n{FORGED}",
        "pid": 424242,
        "host": f"elsewhere{ESC}[2J",
        "updated": time.time(),
        "events": [{"kind": "restart", "start_epoch": f"1\n{FORGED}"}],
        "restarts": f"{ESC}[31m",
        "ranks": [rank],
        "monitor": f"accuracy{ESC}[2J\n{FORGED}",
    }
    (run_dir / "status.json").write_text(json.dumps(status))


@pytest.mark.parametrize("ended", [False, True], ids=["live", "ended"])
def test_status_prints_escapes_and_forged_lines_escaped(tmp_path: Path, ended: bool) -> None:
    run_dir = tmp_path / "run"
    forged_fields(run_dir, ended)
    code, output = onlooker("status", str(run_dir))
    assert code == 0, output
    assert ESC not in output and "\a" not in output, output
    assert "\\x1b" in output, output
    assert not any(line.startswith(FORGED) for line in output.splitlines()), output
    assert f"\\n{FORGED}" in output, output  # shown, as text in the line it belongs to


def test_plot_draws_names_from_the_files_as_plain_text(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path / "run")
    # mathtext would parse this (and fail); a control character would reach the title
    name = "$\\notacommand$" + ESC
    records = [epoch(n, metrics=[name], **{name: 0.5 + n}) for n in range(2)]
    (run_dir / "epochs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = {"run_id": f"$\\frac{ESC}[2J", "config": {"monitor": name, "monitor_mode": name}}
    (run_dir / "run.json").write_text(json.dumps(run))
    code, output = onlooker("plot", str(run_dir))
    assert code == 0, output
    assert ESC not in output
    assert (run_dir / "curve.png").read_bytes().startswith(PNG_SIGNATURE)


@needs_root
def test_plot_never_writes_through_a_link_planted_beside_the_curve(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    before = victim.read_bytes(), os.lstat(victim).st_mtime_ns
    with shared_scratch() as shared:
        run_dir = shared / "run"
        # another user's run directory, with a link at the name the curve was written through
        link = run_dir / ".curve.png.tmp"
        as_other_user(["sh", "-c", f"mkdir -m 755 {run_dir} && ln -s {victim} {link}"])
        a_run(run_dir)
        code, output = onlooker("plot", str(run_dir))
        assert code == 0, output
        curve = os.lstat(run_dir / "curve.png")
    assert stat.S_ISREG(curve.st_mode) and stat.S_IMODE(curve.st_mode) == 0o600
    assert (victim.read_bytes(), os.lstat(victim).st_mtime_ns) == before


def test_plot_output_never_goes_through_a_link(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path / "run")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "plots" / "out.png"
    out.parent.mkdir()
    (out.parent / ".out.png.tmp").symlink_to(victim)
    out.symlink_to(victim)
    code, output = onlooker("plot", str(run_dir), "-o", str(out))
    assert code == 0, output
    assert victim.read_text() == "precious"
    st = os.lstat(out)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
