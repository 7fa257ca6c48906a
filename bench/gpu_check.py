"""The check for a machine with CUDA: epochal on NCCL and the GPUs present, against the same runs
on gloo and the CPU.

    bench/gpu_check.sh [REPORT]                   # on the GPUs; the report to REPORT, else stdout
    python bench/gpu_check.py --device cpu        # the same checks on gloo/CPU: a dry run

Run from the repository root with ``.[test,examples]`` installed. It checks, each on its own line
with PASS or FAIL:

- **digits**: ``examples/digits.py`` through ``epochal run`` (one worker per GPU, the coordinator
  told ``--backend nccl``) and the same run on gloo with CUDA hidden: both finish, on the backend
  asked for, with final losses within :data:`DIGITS_LOSS_RTOL` of each other and validation
  accuracies within :data:`DIGITS_ACCURACY_ATOL`. The example's dropout draws its masks from the
  device's generator, so the two runs are two draws of the same training: on the CPU, six draws
  of the masks alone spread the final validation loss by up to 18 % and the accuracy by 0.02.
- **modes**: every parallel mode (replicated, main, sharded, fully_sharded) in float32, bf16 and
  fp16, trained through ``epochal.fit`` on spawned NCCL ranks (one per GPU; the helpers of
  ``tests/worker/ranks.py``) and on as many gloo ranks on the CPU: every GPU rank ends with the
  same parameters, the loss falls, and the last epoch's loss (over all ranks) is within
  :data:`LOSS_RTOL` of the CPU's. GPU kernels round differently from CPU ones (another order of
  summation, bf16 and fp16 matrix products on tensor cores), so the losses agree to the rounding
  of the precision, not bit for bit.

It also prints the torch, CUDA and NCCL versions, the devices, and which network the data plane
uses: the interface epochal hands gloo and NCCL, the coordinator's "data plane at" line, and
NCCL's own ``NET/Socket : Using`` lines (``NCCL_DEBUG=INFO``). It is sized to finish in under five
minutes on one H200: the whole run on the CPU alone (``--device cpu --nproc 1``, both sides on
the CPU) takes 70 s on a 2-core VM.

Exit status: 0 every check passed; 1 a check failed; 77 skipped, without a CUDA device (one
line says so; ``--device cpu`` runs without one). ``tests/gpu`` runs the same checks at
:data:`SMALL` size under pytest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402  (run_ranks fails a group that outlives its deadline with pytest.fail)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from bench import workload  # noqa: E402
from epochal.worker.dataplane import network  # noqa: E402
from epochal.worker.strategies import MODES  # noqa: E402
from epochal.worker.training.train import fit  # noqa: E402
from tests.worker.ranks import LocalSession, run_ranks, start_rank  # noqa: E402

SKIPPED = 77
"""Exit status without a CUDA device (as automake's test drivers read it: skipped)."""

PRECISIONS = ("32", "bf16", "fp16")
LOSS_RTOL = {"32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
"""How far the last epoch's loss on the GPUs may be from the CPU's, relative, per precision.

Measured on the CPU at :data:`FULL` size, one rank: bf16 moves the last epoch's loss 1.1 % away
from float32's, fp16 0.5 % (at three epochs, 2.1 % and 2.2 %: the further training goes, the more
rounding adds up). A GPU rounds at the same precision as much again, another way, so 5 % leaves
room for both and still catches a step skipped too often, gradients not averaged or a mode that
does not train. In float32 the two differ only in the order of summation."""

DIGITS_LOSS_RTOL = 0.4
DIGITS_ACCURACY_ATOL = 0.04


@dataclass(frozen=True)
class Size:
    """How much the checks train."""

    samples: int
    # training samples, over all ranks (bench/workload.py's synthetic teacher data)
    features: int
    hidden: int
    batch_size: int
    # per rank
    epochs: int
    # epochs of each mode and precision (the learning rate halves every epoch)
    lr: float
    # AdamW's
    digits_epochs: int
    # epochs of the digits example
    deadline: float
    # seconds for one group of spawned ranks, or one digits run, to finish

    def workload(self) -> argparse.Namespace:
        return argparse.Namespace(
            samples=self.samples,
            valid_samples=0,
            features=self.features,
            hidden=self.hidden,
            classes=10,
        )


FULL = Size(
    samples=4096,
    features=256,
    hidden=512,
    batch_size=64,
    epochs=2,
    lr=3e-3,
    digits_epochs=5,
    deadline=240,
)
SMALL = Size(
    samples=512,
    features=32,
    hidden=64,
    batch_size=32,
    epochs=3,
    lr=1e-2,
    digits_epochs=3,
    deadline=150,
)


@dataclass(frozen=True)
class Check:
    """One verdict of the report."""

    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"


# ---------------------------------------------------------------- the modes, on spawned ranks


def rank_batches(size: Size, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: every ``world``-th sample of the workload's training set."""
    train, _ = workload.datasets(size.workload())
    x, y = train.tensors
    x, y = x[rank::world], y[rank::world]
    n = len(x) - len(x) % size.batch_size
    return [
        (x[i : i + size.batch_size], y[i : i + size.batch_size])
        for i in range(0, n, size.batch_size)
    ]


def modes_rank(rank: int, world: int, store: str, backend: str, size: Size, out: str) -> None:
    """In a spawned rank: every mode in every precision through ``fit``; writes what it saw."""
    device = start_rank(rank, world, store, size.deadline, backend)
    data = rank_batches(size, rank, world)
    results: dict[str, Any] = {}
    try:
        for precision in PRECISIONS:
            for mode in MODES:
                torch.manual_seed(10 + rank)  # each rank its own: every mode starts from rank 0's
                model = workload.model(size.workload())
                holder = [model]
                session = LocalSession(
                    rank,
                    world,
                    Path(out) / f"ck-{mode}-{precision}",
                    None,
                    holder,
                    device=device,
                    epochs=size.epochs,
                )
                fit(
                    session,  # type: ignore[arg-type]
                    model,
                    torch.optim.AdamW(model.parameters(), lr=size.lr),
                    data,
                    None,
                    nn.functional.cross_entropy,
                    mode=mode,
                    precision=precision,
                    progress=False,
                )
                sums = torch.tensor(
                    [[s.total, s.count] for s in session.train_sums],
                    dtype=torch.float64,
                    device=device,
                )
                dist.all_reduce(sums)  # the coordinator's sum over the ranks
                results[f"{mode} {precision}"] = {
                    "losses": (sums[:, 0] / sums[:, 1]).tolist(),
                    "last": session.last,  # the weights after the last epoch, on the CPU
                }
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


def run_modes(backend: str, world: int, size: Size, tmp: Path) -> list[dict[str, Any]]:
    """Every mode and precision on ``world`` spawned ranks of ``backend``; each rank's results."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_ranks(modes_rank, world, tmp, backend, size, str(tmp), deadline=size.deadline)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def compare_modes(
    device: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], where: str
) -> list[Check]:
    """One check per mode and precision: ``device``'s ranks against ``reference``'s."""
    checks = []
    for precision in PRECISIONS:
        for mode in MODES:
            key = f"{mode} {precision}"
            ranks = [r[key] for r in device]
            losses, want = ranks[0]["losses"], reference[0][key]["losses"][-1]
            got, tol = losses[-1], LOSS_RTOL[precision]
            apart = abs(got - want) / abs(want) if want else math.inf
            differ = [
                i
                for i, r in enumerate(ranks[1:], 1)
                if r["last"].keys() != ranks[0]["last"].keys()
                or any(not torch.equal(v, ranks[0]["last"][k]) for k, v in r["last"].items())
            ]
            finite = all(math.isfinite(v) for v in losses)
            falls = finite and losses[-1] < losses[0]
            problems = []
            if not finite:
                problems.append("a loss is not finite")
            elif not falls:
                problems.append("the loss did not fall")
            if differ:
                problems.append(f"rank(s) {differ} hold other parameters than rank 0")
            if not apart <= tol:
                problems.append(f"the loss is {apart:.1e} away from the CPU's (tolerance {tol:g})")
            detail = (
                f"last epoch's loss {got:.6f} on {where}, {want:.6f} on the CPU "
                f"(apart {apart:.1e}, tolerance {tol:g}); "
                f"epoch 0 {losses[0]:.4f}; {len(ranks)} rank(s) "
                + ("hold the same parameters" if not differ else "DISAGREE")
            )
            if problems:
                detail += " -- " + "; ".join(problems)
            checks.append(Check(f"modes {key}", not problems, detail))
    return checks


# ---------------------------------------------------------------- digits, through epochal run


@dataclass(frozen=True)
class DigitsRun:
    """What one ``epochal run`` of the digits example showed."""

    code: int
    # the launcher's exit status
    backend: str | None
    # the backend the coordinator chose ("run ...: N workers, backend nccl, ...")
    placement: list[str]
    # the coordinator's lines saying where the ranks are ("ranks 0-1: host, data plane at ...")
    nccl_net: list[str]
    # NCCL's lines naming the network it chose (NCCL_DEBUG=INFO)
    last: dict[str, Any]
    # the last epoch's journal record (train_loss, valid_loss, valid_accuracy, ...)
    tail: str
    # the end of the output, for a failure


def digits_command(
    device: str, world: int, epochs: int, run_dir: Path
) -> tuple[list[str], dict[str, str]]:
    """The arguments of ``python -m epochal`` and the environment for one digits run: on the
    GPUs (``cuda``, NCCL asked for) or on the CPU (gloo, CUDA hidden from the workers)."""
    args = [
        "run",
        "--nproc",
        str(world),
        "--epochs",
        str(epochs),
        "--checkpoint-every",
        "0",
        "--no-status",
        "--verbose",  # every line the workers print, NCCL's included
        "--backend",
        "nccl" if device == "cuda" else "gloo",
        "--run-dir",
        str(run_dir),
        str(REPO / "examples" / "digits.py"),
    ]
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
    if device != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return args, env


NCCL_NET = re.compile(r"NET/Socket : Using|NET/IB : Using|Bootstrap ?: Using|Using network|IFNAME")
"""NCCL's lines (NCCL_DEBUG=INFO) that name the network and interface it chose."""


def read_digits(code: int, output: str, run_dir: Path) -> DigitsRun:
    """A finished digits run, from its output and its journal."""
    backend = re.search(r"workers, backend (\w+)", output)
    placement = [m.group(0) for m in re.finditer(r"ranks? [\d-]+: .*data plane at \S+", output)]
    nccl: list[str] = []
    for line in output.splitlines():
        if NCCL_NET.search(line):
            text = line.split("NCCL INFO", 1)[-1].strip()
            if text not in nccl:
                nccl.append(text)
    journal = run_dir / "epochs.jsonl"
    records = []
    if journal.is_file():
        records = [json.loads(x) for x in journal.read_text().splitlines() if x.strip()]
    return DigitsRun(
        code=code,
        backend=backend.group(1) if backend else None,
        placement=placement,
        nccl_net=nccl,
        last=records[-1] if records else {},
        tail="\n".join(output.splitlines()[-15:]),
    )


def compare_digits(
    device: DigitsRun, reference: DigitsRun, where: str, backend: str
) -> list[Check]:
    """The digits run on ``where`` (asked for ``backend``) and on the CPU (gloo)."""
    checks = []
    for name, run, asked in ((where, device, backend), ("the CPU (reference)", reference, "gloo")):
        ok = run.code == 0 and run.backend == asked and bool(run.last)
        detail = (
            f"exit status {run.code}, backend {run.backend} (asked for {asked}), "
            f"{run.last.get('epoch', -1) + 1} epoch(s) journaled"
        )
        checks.append(
            Check(f"digits runs on {name}", ok, detail if ok else detail + "\n" + run.tail)
        )
    if not (device.last and reference.last):
        checks.append(Check("digits matches the CPU", False, "a run journaled no epoch"))
        return checks
    problems, parts = [], []
    for key in ("train_loss", "valid_loss"):
        got, want = float(device.last[key]), float(reference.last[key])
        apart = abs(got - want) / abs(want) if want else math.inf
        parts.append(f"{key} {got:.4f} / {want:.4f} (apart {apart:.2f})")
        if not apart <= DIGITS_LOSS_RTOL:
            problems.append(f"{key} apart by more than {DIGITS_LOSS_RTOL:g}")
    got, want = float(device.last["valid_accuracy"]), float(reference.last["valid_accuracy"])
    parts.append(f"valid_accuracy {got:.4f} / {want:.4f}")
    if not abs(got - want) <= DIGITS_ACCURACY_ATOL:
        problems.append(f"valid_accuracy apart by more than {DIGITS_ACCURACY_ATOL:g}")
    detail = (
        f"last epoch on {where} / on the CPU: "
        + ", ".join(parts)
        + f" (tolerance: losses {DIGITS_LOSS_RTOL:g} relative, accuracy {DIGITS_ACCURACY_ATOL:g})"
    )
    if problems:
        detail += " -- " + "; ".join(problems)
    checks.append(Check("digits matches the CPU", not problems, detail))
    return checks


def run_digits(device: str, world: int, size: Size, tmp: Path) -> DigitsRun:
    """One digits run through ``epochal run`` in ``tmp``, its process group killed at the
    deadline."""
    tmp.mkdir(parents=True)
    run_dir = tmp / "run"
    args, extra = digits_command(device, world, size.digits_epochs, run_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    env.update(extra, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "epochal", *args],
        env=env,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=size.deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n(killed after {size.deadline:g} s)"
    return read_digits(proc.returncode, output, run_dir)


# ---------------------------------------------------------------- the report


def versions() -> list[str]:
    """torch, CUDA, NCCL and the devices, one fact a line."""
    lines = [f"python {platform.python_version()}, torch {torch.__version__}"]
    if not torch.cuda.is_available():
        return [*lines, "CUDA: not available; NCCL: not used"]
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError) as exc:
        nccl = f"unknown ({exc})"
    lines.append(
        f"CUDA {torch.version.cuda} (driver sees {torch.cuda.device_count()} device(s)), "
        f"NCCL {nccl}, cuDNN {torch.backends.cudnn.version()}"
    )
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(
            f"cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, "
            f"{p.total_memory / 2**30:.0f} GiB"
        )
    return lines


def network_lines(device: DigitsRun | None) -> list[str]:
    """Which network the data plane uses: epochal's choice and what the libraries said."""
    plane = network.discover("tcp://127.0.0.1:1")  # epochal run's coordinator is on loopback
    lines = [
        f"epochal's data plane for a coordinator on this machine: {plane.address} on "
        f"{plane.ifname} ({plane.source}); gloo gets "
        f"{network.GLOO_IFNAME_ENV}={os.environ.get(network.GLOO_IFNAME_ENV) or plane.ifname}, "
        f"NCCL {network.NCCL_IFNAME_ENV}={os.environ.get(network.NCCL_IFNAME_ENV) or plane.ifname}"
    ]
    if device is None:
        return lines
    lines += [f"coordinator: {line}" for line in device.placement] or [
        "coordinator: no 'data plane at' line seen"
    ]
    lines += [f"NCCL: {line}" for line in device.nccl_net] or [
        "NCCL: no NET/Socket line seen (gloo, or NCCL opened no socket transport)"
    ]
    return lines


def check(
    device: str, world: int, size: Size, tmp: Path, say: TextIO
) -> tuple[list[Check], DigitsRun]:
    """Every check on ``device`` against the CPU, and the digits run on ``device`` (for the
    network lines); progress to ``say``."""
    checks: list[Check] = []
    backend = "nccl" if device == "cuda" else "gloo"
    started = time.monotonic()

    def note(what: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {what}", file=say, flush=True)

    note(f"digits on {device}, {world} rank(s)")
    on_device = run_digits(device, world, size, tmp / "digits-checked")
    note("digits on the CPU (the reference)")
    on_cpu = run_digits("cpu", world, size, tmp / "digits-reference")
    checks += compare_digits(on_device, on_cpu, device, backend)
    results = {}
    for side, side_backend in (("checked", backend), ("reference", "gloo")):
        note(f"modes x precisions on {world} {side_backend} rank(s) ({side})")
        try:
            results[side] = run_modes(side_backend, world, size, tmp / f"modes-{side}")
        except (Exception, pytest.fail.Exception) as exc:
            where = device if side == "checked" else "the CPU"
            checks.append(Check(f"modes run on {where}", False, f"{type(exc).__name__}: {exc}"))
    if len(results) == 2:
        checks += compare_modes(results["checked"], results["reference"], device)
    note("done")
    return checks, on_device


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", default="-", help="where the report goes ('-': stdout)")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="what is checked against the CPU: cuda (NCCL, one rank per GPU) or cpu (a dry run)",
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2)")
    parser.add_argument("--size", choices=["full", "small"], default="full")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' files here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        line = (
            f"gpu_check: skipped (exit {SKIPPED}): no CUDA device here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False); --device cpu runs the same checks on the CPU"
        )
        print(line, file=sys.stderr if args.report == "-" else sys.stdout, flush=True)
        if args.report != "-":
            Path(args.report).write_text(line + "\n")
        return SKIPPED
    world = args.nproc
    if world is None:
        world = torch.cuda.device_count() if args.device == "cuda" else 2
    if world < 1 or (args.device == "cuda" and world > torch.cuda.device_count()):
        parser.error(
            f"--nproc {world}: give 1 to {torch.cuda.device_count()} ranks, one per GPU (NCCL "
            "refuses two ranks on one device)"
            if args.device == "cuda"
            else f"--nproc {world}: give 1 rank or more"
        )
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep}: give a new or empty directory")
    size = FULL if args.size == "full" else SMALL
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        checks, on_device = check(args.device, world, size, tmp, sys.stderr)
    failed = sum(not c.passed for c in checks)
    header = [
        f"epochal GPU check, {time.strftime('%Y-%m-%d %H:%M:%S')} on {platform.node()}",
        f"exit status: 0 every check passed, 1 a check failed, {SKIPPED} skipped (no CUDA device)",
        f"checked: {args.device} ({'NCCL' if args.device == 'cuda' else 'gloo'}), {world} rank(s), "
        f"size {args.size} ({json.dumps(asdict(size))}); reference: the same on gloo/CPU",
        *versions(),
        *network_lines(on_device),
        "",
    ]
    footer = [
        "",
        f"{len(checks) - failed} passed, {failed} failed in {time.monotonic() - began:.0f} s",
    ]
    text = "\n".join([*header, *(c.line() for c in checks), *footer]) + "\n"
    if args.report == "-":
        sys.stdout.write(text)
    else:
        Path(args.report).write_text(text)
        print(f"gpu_check: {footer[-1]}; report in {args.report}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
