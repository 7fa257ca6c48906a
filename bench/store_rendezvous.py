"""What the data-plane store's protection costs: rendezvous time, ours against plain TCPStore.

Epochal's store (:mod:`epochal.worker.dataplane.store`) is a TCPStore listening only on the
advertised address, served by a process of its own whose memory is capped, with every key under a
per-run secret (a PrefixStore). This measures the part of a rendezvous that goes through the store,
with N ranks as threads that use the store API alone (no training, no process group): each rank
connects, publishes its address under its rank, then reads every other rank's; and, apart, the time
to open the store (for epochal's, starting its server process). Plain: ``TCPStore(host, 0,
is_master=True)`` as torch opens it (every interface, bare keys, in this process). Both in the same
run, alternating; the median of the repeats and the ratio.

    python bench/store_rendezvous.py [--ranks 2 8 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from epochal.worker.dataplane.store import connect_store, new_key, open_store, scoped

TIMEOUT = 60.0


def rendezvous(ranks: int, server: Any, view: Callable[[Any], Any], port: int) -> float:
    """Seconds from the first connect until every rank has read every other rank's address."""
    errors: list[BaseException] = []
    start = threading.Barrier(ranks + 1)

    def rank(r: int) -> None:
        try:
            start.wait()
            store = view(connect_store("127.0.0.1", port, TIMEOUT))
            store.set(f"addr/{r}", f"127.0.0.1:{20000 + r}")
            for other in range(ranks):
                store.get(f"addr/{other}")  # blocks until that rank has published
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - began


def plain(ranks: int) -> tuple[float, float]:
    """(seconds to open the store, seconds of the rendezvous)."""
    began = time.perf_counter()
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT)
    )
    opened = time.perf_counter() - began
    return opened, rendezvous(ranks, server, lambda s: s, server.port)


def ours(ranks: int) -> tuple[float, float]:
    """(seconds to open the store, its server process included; seconds of the rendezvous)."""
    began = time.perf_counter()
    server = open_store("127.0.0.1", TIMEOUT)
    opened = time.perf_counter() - began
    key = new_key()
    return opened, rendezvous(ranks, server, lambda s: scoped(s, "bench", key), server.port)


def span(values: list[float]) -> str:
    ms = [1000 * v for v in values]
    return f"{statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("median (min-max) over the repeats; ratio of the medians, epochal / plain")
    print(f"{'ranks':>5}  {'plain TCPStore':>24}  {'epochal store':>24}  {'ratio':>6}")
    opening: tuple[list[float], list[float]] = ([], [])
    for n in args.ranks:
        base, mine = [], []
        for _ in range(args.repeats):
            for times, opens, measure in ((base, opening[0], plain), (mine, opening[1], ours)):
                opened, took = measure(n)
                opens.append(opened)
                times.append(took)
        b, m = statistics.median(base), statistics.median(mine)
        print(f"{n:>5}  {span(base):>24}  {span(mine):>24}  {m / b:>6.2f}", flush=True)
    b, m = statistics.median(opening[0]), statistics.median(opening[1])
    print(f"{'open':>5}  {span(opening[0]):>24}  {span(opening[1]):>24}  {m / b:>6.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
