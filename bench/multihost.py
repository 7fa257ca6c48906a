"""The digits workload on three hosts (network namespaces) against the same run on one host.

    sudo python bench/multihost.py                 # 20 epochs per run
    sudo python bench/multihost.py --epochs 40 --repeats 3

Each configuration is the same invocation: a coordinator (CURVE keys, ``--checkpoint-every 0``)
and two workers running ``examples/digits.py``, with no network hints. "one host" puts all three
processes on one namespace host; "3 hosts" puts the coordinator and each worker on a host of its
own, joined by a bridge; "3 hosts + netem" adds 2 ms delay and 0.1% loss to every host's link
(when the kernel has netem). From the coordinator's journal it prints, per configuration, the
median epoch time (decision to decision) and its ratio to one host, and the median control time:
the part of each epoch that is not the workers' training (from the decision of epoch k-1 to the
Go of epoch k: the workers' ready, the coordinator's plan, the Go across the hosts). Epoch 0
(warm-up) is left out. Needs root, like the tests in ``tests/multihost``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.multihost import netns  # noqa: E402

DIGITS = REPO / "examples" / "digits.py"
PORT = 29400


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPOCHAL_", "GLOO_", "NCCL_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "EPOCHAL_PROGRESS": "0", **extra})
    return env


def one_run(net: netns.Network, places: list[int], epochs: int, scratch: Path) -> list[dict]:
    """Coordinator on host 0, worker i on host ``places[i]``; the journal's epoch records."""
    scratch.mkdir(parents=True)
    keys = scratch / "keys"
    subprocess.run(
        [sys.executable, "-m", "epochal", "keys", "generate", "--workers", "2", str(keys)],
        check=True,
        capture_output=True,
        env=clean_env(),
    )
    endpoint = f"tcp://{net[0].address}:{PORT}"
    run_dir = scratch / "run"
    log = (scratch / "log").open("w")
    argv = ["python", "-m", "epochal", "coordinator", "--bind", endpoint, "--world-size", "2"]
    argv += ["--curve-key", str(keys / "coordinator.key_secret")]
    argv += ["--curve-allowed", str(keys / "allowed"), "--epochs", str(epochs)]
    argv += ["--checkpoint-every", "0", "--run-dir", str(run_dir)]
    coordinator = net[0].popen(
        argv,
        env=clean_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    workers = [
        net[place].popen(
            ["python", str(DIGITS)],
            env=clean_env(
                EPOCHAL_COORDINATOR=endpoint,
                EPOCHAL_RANK=str(i),
                EPOCHAL_CURVE_KEY=str(keys / "workers" / f"worker-{i}.key_secret"),
                EPOCHAL_CURVE_SERVER_KEY=str(keys / "coordinator.key"),
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for i, place in enumerate(places)
    ]
    codes = [p.wait(timeout=600) for p in [*workers, coordinator]]
    log.close()
    if any(codes):
        sys.exit(f"a run failed (exit codes {codes}):\n{(scratch / 'log').read_text()}")
    records = [json.loads(line) for line in (run_dir / "epochs.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "epoch"]


def figures(records: list[dict]) -> tuple[float, float]:
    """Median epoch time and median control time, epoch 0 left out."""
    epochs, control = [], []
    for before, now in itertools.pairwise(records):
        interval = now["time"] - before["time"]
        epochs.append(interval)
        control.append(interval - now["seconds"])
    return statistics.median(epochs), statistics.median(control)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="epochs per run (default: 20)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration")
    args = parser.parse_args()
    reason = netns.available()
    if reason is not None:
        sys.exit(reason)
    configs: list[tuple[str, int, list[int], tuple[str, ...]]] = [
        ("one host", 1, [0, 0], ()),
        ("3 hosts", 3, [1, 2], ()),
        ("3 hosts + netem 2ms/0.1%", 3, [1, 2], ("delay", "2ms", "loss", "0.1%")),
    ]
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="epochal-multihost-") as tmp:
        for repeat in range(args.repeats):
            for name, count, places, shaping in configs:
                with netns.hosts(count) as net:
                    try:
                        for host in net:
                            if shaping:
                                host.netem(*shaping)
                    except netns.NetemUnavailable as exc:
                        print(f"{name}: skipped: {exc}", flush=True)
                        continue
                    scratch = Path(tmp) / f"{repeat}-{count}-{len(shaping)}"
                    records = one_run(net, places, args.epochs, scratch)
                results.setdefault(name, []).append(figures(records))
                epoch, control = results[name][-1]
                ms = f"epoch {1000 * epoch:.1f} ms, control {1000 * control:.2f} ms"
                print(f"{name} #{repeat}: {ms}", flush=True)
    base = statistics.median(e for e, _ in results["one host"])
    print(f"\n{'configuration':<28}{'epoch ms':>10}{'ratio':>8}{'control ms':>12}")
    for name, runs in results.items():
        epoch = statistics.median(e for e, _ in runs)
        control = statistics.median(c for _, c in runs)
        print(f"{name:<28}{1000 * epoch:>10.1f}{epoch / base:>8.3f}{1000 * control:>12.2f}")
    print(f"\n{args.epochs} epochs per run, epoch 0 left out, {args.repeats} run(s) each; medians")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
