"""The GPU check itself, on any machine: its verdicts on results made up to pass or fail, its one
line and exit status 77 without a CUDA device, and the whole check run on gloo/CPU against itself
(``--device cpu``, the dry run of what a GPU machine runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.gpu_check import (
    LOSS_RTOL,
    PRECISIONS,
    SKIPPED,
    DigitsRun,
    compare_digits,
    compare_modes,
    main,
)
from epochal.worker.strategies import MODES
from tests.integration.conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"


def ranks(world: int, loss: float, changes: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Made-up results of ``world`` ranks: every mode and precision trained from 2.0 to ``loss``,
    every rank with the same weights; ``changes`` replaces entries of rank ``world - 1``."""
    out = []
    for r in range(world):
        results = {
            f"{m} {p}": {"losses": [2.0, loss], "last": {"w": torch.ones(3)}}
            for m in MODES
            for p in PRECISIONS
        }
        if r == world - 1:
            results.update(changes or {})
        out.append(results)
    return out


def verdicts(device: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, bool]:
    return {c.name: c.passed for c in compare_modes(device, reference, "cuda")}


def test_the_modes_pass_within_the_tolerance_and_fail_outside_it():
    reference = ranks(1, 1.0)
    assert all(verdicts(ranks(2, 1.0), reference).values())
    near = ranks(2, 1.0 + 0.9 * LOSS_RTOL["bf16"])
    got = verdicts(near, reference)
    assert [k for k, ok in got.items() if not ok] == [f"modes {m} 32" for m in MODES]
    assert not any(verdicts(ranks(2, 1.0 + 1.1 * LOSS_RTOL["bf16"]), reference).values())


def test_a_rank_with_other_weights_a_nan_or_a_loss_that_does_not_fall_fails_its_mode():
    reference = ranks(1, 1.0)
    other = {"losses": [2.0, 1.0], "last": {"w": torch.ones(3) + 1e-6}}
    nan = {"losses": [2.0, float("nan")], "last": {"w": torch.ones(3)}}
    flat = {"losses": [1.0, 1.0], "last": {"w": torch.ones(3)}}
    # the losses are over all ranks (the same on each): rank 0's are read; weights on every rank
    for bad, world, why in (
        (other, 2, "rank(s) [1] hold other parameters than rank 0"),
        (nan, 1, "a loss is not finite"),
        (flat, 1, "the loss did not fall"),
    ):
        got = compare_modes(ranks(world, 1.0, {"main fp16": bad}), reference, "cuda")
        assert [c.name for c in got if not c.passed] == ["modes main fp16"]
        assert why in next(c.line() for c in got if not c.passed)


def digits(backend: str, loss: float, accuracy: float, code: int = 0) -> DigitsRun:
    last = {"epoch": 2, "train_loss": loss, "valid_loss": loss, "valid_accuracy": accuracy}
    return DigitsRun(code, backend, [], [], last, "the end of the output")


def test_the_digits_runs_must_finish_on_the_backend_asked_for_and_learn_alike():
    def passed(device: DigitsRun, reference: DigitsRun) -> list[bool]:
        return [c.passed for c in compare_digits(device, reference, "cuda", "nccl")]

    cpu = digits("gloo", 0.3, 0.90)
    assert passed(digits("nccl", 0.35, 0.92), cpu) == [True, True, True]
    assert passed(digits("gloo", 0.3, 0.90), cpu) == [False, True, True]  # nccl was asked for
    assert passed(digits("nccl", 0.3, 0.90, code=1), cpu) == [False, True, True]
    assert passed(digits("nccl", 0.6, 0.90), cpu) == [True, True, False]  # losses 2x apart
    assert passed(digits("nccl", 0.3, 0.80), cpu) == [True, True, False]  # accuracy 0.1 apart
    empty = DigitsRun(1, None, [], [], {}, "Traceback ...")
    assert passed(empty, cpu) == [False, True, False]


def run_script(*args: str, deadline: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_the_check_says_so_in_one_line_and_exits_77(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "report.txt"
    done = run_script(str(report), deadline=60)
    assert done.returncode == SKIPPED, done.stdout + done.stderr
    said = (done.stdout + done.stderr).splitlines()
    assert len(said) == 1 and "skipped" in said[0] and "no CUDA device" in said[0], said
    assert report.read_text().splitlines() == said
    # the report to stdout: the line alone, on stderr (main itself: a second start of the
    # script would only import torch again)
    assert main(["--report", "-"]) == SKIPPED
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == said


CPU_CHECK_DEADLINE = 600.0
"""Seconds the whole check on the CPU may take (every mode and precision, then digits twice)."""


@pytest.mark.slow
@pytest.mark.timeout(int(CPU_CHECK_DEADLINE) + 60)  # the deadline below fails it first, clearly
def test_the_check_on_the_cpu_against_itself_passes_every_check(tmp_path: Path):
    report = tmp_path / "report.txt"
    done = run_script(
        str(report), "--device", "cpu", "--size", "small", deadline=CPU_CHECK_DEADLINE
    )
    text = report.read_text() if report.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text
    verdicts = [line for line in text.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 3 + len(MODES) * len(PRECISIONS), text
    assert all(line.startswith("PASS") for line in verdicts), text
    assert "torch " in text and "data plane at 127.0.0.1" in text, text
