"""The digits workload on three hosts (network namespaces) against the same run on one host.

    sudo python bench/multihost.py                 # 20 epochs per run
    sudo python bench/multihost.py --epochs 40 --repeats 3

Each configuration is the same invocation: a coordinator (CURVE keys, ``--checkpoint-every 0``)
and two workers running ``examples/digits.py``, with no network hints. "one host" puts all three
processes on one namespace host; "3 hosts" puts the coordinator and each worker on a host of its
own, joined by a bridge; "3 hosts + 2ms/0.1%" adds 2 ms delay and 0.1% loss to every link:
with netem when the kernel has it, otherwise with the userspace switch of
``tests/multihost/switch.py``. That switch costs time of its own, so when it is used a row
"3 hosts + switch 0ms/0%" (the switch, no impairment) is measured too: compare the impaired row
with it for the cost of the impairment, with "3 hosts" for the cost of switch and impairment.
From the coordinator's journal it prints, per configuration, the median epoch time (decision to
decision) and its ratio to one host, and the median control time: the part of each epoch that
is not the workers' training (from the decision of epoch k-1 to the Go of epoch k: the workers'
ready, the coordinator's plan, the Go across the hosts). Epoch 0 (warm-up) is left out. For each
three-host configuration it also prints the median UDP round trip between the two worker hosts
(``tests/multihost/probe.py``, 50 probes). Needs root, like the tests in ``tests/multihost``.
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
PROBE = REPO / "tests" / "multihost" / "probe.py"
PORT = 29400
ECHO_PORT = 29500


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


def round_trip(net: netns.Network) -> float:
    """Median UDP round trip from host 1 to host 2, in seconds (ARP resolved first)."""
    echo = net[2].popen(["python", str(PROBE), "echo", str(ECHO_PORT)], stdout=subprocess.PIPE)
    assert echo.stdout is not None
    echo.stdout.readline()
    argv = ["python", str(PROBE), "rtt", net[2].address, str(ECHO_PORT), "--count"]
    net[1].run(*argv, "3")
    rtts = json.loads(net[1].run(*argv, "50"))["rtts"]
    echo.kill()
    echo.wait()
    echo.stdout.close()
    return statistics.median(rtts)


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
    # name, hosts, worker places, impairment (delay ms, loss %, userspace only) or None
    configs: list[tuple[str, int, list[int], tuple[float, float, bool] | None]] = [
        ("one host", 1, [0, 0], None),
        ("3 hosts", 3, [1, 2], None),
        ("3 hosts + 2ms/0.1%", 3, [1, 2], (2.0, 0.1, False)),
        ("3 hosts + switch 0ms/0%", 3, [1, 2], (0.0, 0.0, True)),
    ]
    results: dict[str, list[tuple[float, float]]] = {}
    rtts: dict[str, list[float]] = {}
    how = ""
    runs = itertools.count()
    with tempfile.TemporaryDirectory(prefix="epochal-multihost-") as tmp:
        for repeat in range(args.repeats):
            for name, count, places, impairment in configs:
                with netns.hosts(count) as net:
                    if impairment is not None:
                        delay, loss, userspace = impairment
                        if userspace and how == "netem":
                            continue  # the switch is not used, so its cost is not either
                        if not userspace:
                            how = net.impair(delay, loss)
                            name = f"{name} ({how})"
                        else:
                            net.impair(delay, loss, userspace=True)
                    if count > 1:
                        rtts.setdefault(name, []).append(round_trip(net))
                    scratch = Path(tmp) / f"run{next(runs)}"
                    records = one_run(net, places, args.epochs, scratch)
                results.setdefault(name, []).append(figures(records))
                epoch, control = results[name][-1]
                ms = f"epoch {1000 * epoch:.1f} ms, control {1000 * control:.2f} ms"
                if name in rtts:
                    ms += f", round trip {1000 * rtts[name][-1]:.3f} ms"
                print(f"{name} #{repeat}: {ms}", flush=True)
    base = statistics.median(e for e, _ in results["one host"])
    head = f"{'configuration':<36}{'epoch ms':>10}{'ratio':>8}{'control ms':>12}{'rtt ms':>9}"
    print(f"\n{head}")
    for name, runs in results.items():
        epoch = statistics.median(e for e, _ in runs)
        control = statistics.median(c for _, c in runs)
        rtt = f"{1000 * statistics.median(rtts[name]):>9.3f}" if name in rtts else f"{'-':>9}"
        row = f"{name:<36}{1000 * epoch:>10.1f}{epoch / base:>8.3f}{1000 * control:>12.2f}{rtt}"
        print(row)
    print(f"\n{args.epochs} epochs per run, epoch 0 left out, {args.repeats} run(s) each; medians")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
