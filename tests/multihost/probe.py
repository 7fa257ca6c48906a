"""UDP probes between namespace hosts: round-trip times and one-way loss, printed as JSON.

    python tests/multihost/probe.py echo PORT                 # on one host: echo every datagram
    python tests/multihost/probe.py rtt HOST PORT --count 20  # on another: {"rtts": [...], ...}
    python tests/multihost/probe.py sink PORT --idle 2        # count datagrams until idle
    python tests/multihost/probe.py send HOST PORT --count 2000

``echo`` and ``sink`` print ``ready`` once bound. ``rtt`` sends one numbered datagram at a time
and waits up to ``--timeout`` for its echo (a lost one counts as lost, not as a time); ``send``
paces ``--count`` datagrams ``--interval`` apart, then sends an end mark every ``END_INTERVAL``
until the sink's host answers that nothing listens any more; ``sink`` prints how many distinct
datagrams arrived once the first end mark does (they travel the same path in order, so every
datagram sent before it has arrived or been lost by then), or once nothing came for ``--idle``
seconds, which only a failure takes. Its receive buffer holds seconds of traffic, so a loaded
machine that leaves it unread for a while loses nothing there. No ``ping`` needed.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import time

END = b"end"
"""What ``send`` sends after its datagrams, for the sink to stop at."""

END_INTERVAL = 0.02
"""Seconds between end marks (one may be lost like any datagram)."""

END_MARKS = 500
"""End marks at most: ``send`` stops sooner, once the sink's host says its port is closed."""

SINK_BUFFER = 8 << 20
"""Bytes of the sink's receive buffer: tens of thousands of probe datagrams."""

SO_RCVBUFFORCE = 33
"""asm-generic/socket.h: SO_RCVBUF past net.core.rmem_max, for root; the socket module lacks it."""


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
        try:  # root (as in these tests) may exceed net.core.rmem_max
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, SINK_BUFFER)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SINK_BUFFER)
        sock.bind(("0.0.0.0", port))
        print("ready", flush=True)
        sock.settimeout(None)
        while True:
            try:
                data = sock.recv(2048)
            except TimeoutError:
                break
            if data == END:
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
        for _ in range(END_MARKS):
            try:  # a port unreachable from the sink's host, once it has stopped, ends this
                sock.send(END)
                time.sleep(END_INTERVAL)
            except ConnectionRefusedError:
                break
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
