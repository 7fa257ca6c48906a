"""The launcher's output prefixing and the CLI's argument handling, without starting workers."""

from __future__ import annotations

import functools
import io
import os
import subprocess
import sys

import pytest

from epochal.cli import build_parser
from epochal.launcher import ORPHAN_EXIT_CODE, _die_with_parent, _Prefixer


def test_prefixer_splits_lines_and_keeps_carriage_returns():
    out = io.StringIO()
    p = _Prefixer("[rank 1] ", out)
    p.feed("hel")
    assert out.getvalue() == ""
    p.feed("lo\nbar 1\rbar 2\rdone\n\ntail")
    p.close()
    assert out.getvalue() == (
        "[rank 1] hello\n[rank 1] bar 1\r[rank 1] bar 2\r[rank 1] done\n[rank 1] \n[rank 1] tail\n"
    )


def test_parser_requires_world_size_and_validates_numbers():
    parser = build_parser()
    args = parser.parse_args(["run", "--nproc", "2", "s.py", "--lr", "0.1"])
    assert (args.nproc, args.script, args.script_args) == (2, "s.py", ["--lr", "0.1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["coordinator"])
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--nproc", "2", "--rendezvous-timeout", "-1", "s.py"])


def test_cli_does_not_import_torch():
    code = (
        "import sys, epochal.cli, epochal.launcher, epochal.coordinator; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("orphaned", [False, True])
def test_a_worker_whose_launcher_died_while_starting_it_leaves(orphaned):
    # the child's parent is this process; an orphaned child sees another parent (the reaper),
    # which is what "expected parent" differing from getppid() stands for here
    expected = os.getppid() if orphaned else os.getpid()
    proc = subprocess.run(
        [sys.executable, "-c", "pass"],
        preexec_fn=functools.partial(_die_with_parent, expected),
        timeout=60,
    )
    assert proc.returncode == (ORPHAN_EXIT_CODE if orphaned else 0)
