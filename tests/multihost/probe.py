"""UDP probes between namespace hosts: round-trip times and one-way loss, printed as JSON.

    python tests/multihost/probe.py echo PORT                 # on one host: echo every datagram
    python tests/multihost/probe.py rtt HOST PORT --count 20  # on another: {"rtts": [...], ...}
    python tests/multihost/probe.py sink PORT --idle 2        # count datagrams until idle
    python tests/multihost/probe.py send HOST PORT --count 2000

``echo`` and ``sink`` print ``ready`` once bound. ``rtt`` sends one numbered datagram at a time
and waits up to ``--timeout`` for its echo (a lost one counts as lost, not as a time); ``send``
paces ``--count`` datagrams ``--interval`` apart, and ``sink`` prints how many distinct ones
arrived once nothing came for ``--idle`` seconds after the first. No ``ping`` needed.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import time


def echo(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", port))
        print("ready", flush=True)
        while True:
            data, peer = sock.recvfrom(2048)
            sock.sendto(data, peer)


def rtt(host: str, port: int, count: int, timeout: float) -> dict[str, object]:
    times: list[float] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        for seq in range(count):
            sent = time.monotonic()
            sock.send(struct.pack("!Q", seq))
            deadline = sent + timeout
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data = sock.recv(2048)
                except TimeoutError:
                    break
                if struct.unpack("!Q", data[:8])[0] == seq:
                    times.append(time.monotonic() - sent)
                    break
    return {"sent": count, "received": len(times), "rtts": times}


def sink(port: int, idle: float) -> dict[str, object]:
    seen: set[int] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("0.0.0.0", port))
        print("ready", flush=True)
        sock.settimeout(None)
        while True:
            try:
                data = sock.recv(2048)
            except TimeoutError:
                break
            seen.add(struct.unpack("!Q", data[:8])[0])
            sock.settimeout(idle)
    return {"received": len(seen)}


def send(host: str, port: int, count: int, interval: float) -> dict[str, object]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        start = time.monotonic()
        for seq in range(count):
            time.sleep(max(0.0, start + seq * interval - time.monotonic()))
            sock.send(struct.pack("!Q", seq) + bytes(56))
    return {"sent": count}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("echo")
    p.add_argument("port", type=int)
    p = sub.add_parser("rtt")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--timeout", type=float, default=2.0)
    p = sub.add_parser("sink")
    p.add_argument("port", type=int)
    p.add_argument("--idle", type=float, default=2.0)
    p = sub.add_parser("send")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--interval", type=float, default=0.001)
    args = parser.parse_args()
    if args.what == "echo":
        echo(args.port)
        return 0
    if args.what == "rtt":
        result = rtt(args.host, args.port, args.count, args.timeout)
    elif args.what == "sink":
        result = sink(args.port, args.idle)
    else:
        result = send(args.host, args.port, args.count, args.interval)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
