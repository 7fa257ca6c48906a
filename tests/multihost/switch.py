"""A userspace Ethernet switch that delays and drops frames, for kernels without netem.

    ip netns exec SWITCH python tests/multihost/switch.py --port p0 --port p1 \\
        --delay-ms 50 --loss 0.01 --seed 1

It opens an ``AF_PACKET`` raw socket on each port (a veth whose peer is a host's ``eth0``) and
forwards every frame it receives to the port that last sent from the destination MAC, or to
every other port when that is not known yet or the frame is a broadcast (a learning switch, so
ARP works as on a bridge). Each frame is dropped with probability ``--loss`` (seeded RNG) and
otherwise sent ``--delay-ms`` after it arrived. The delay is the same for every frame, so a FIFO
per output port keeps every port's order. A queue holds at most ``--queue`` frames; the excess
is dropped, as a full queue would.

It prints ``ready`` once every port is open. On SIGTERM it prints one line of counters on
stderr (``forwarded=… lost=… overflow=… oversize=… errors=… unread=…``) and exits 0: ``unread``
counts the frames the kernel dropped because the switch did not read its ports fast enough (their
receive buffers hold seconds of traffic, so only a machine loaded far beyond a test's own needs
sees any), so they are never mistaken for the frames it lost on purpose. ``--offloads-off IFNAME``
instead turns off checksum and segmentation offloads on an interface of the current namespace
and exits: frames read from a raw socket must be whole, checksummed Ethernet frames no larger
than the MTU, which a host's veth does not guarantee with its offloads on. (With the checksum
offload on, a host's TCP segments reach the other host with a bad checksum and are dropped.)
"""

from __future__ import annotations

import argparse
import array
import collections
import fcntl
import random
import select
import signal
import socket
import struct
import sys
import time
from types import FrameType

ETH_P_ALL = 3
SIOCETHTOOL = 0x8946
# Legacy ethtool "set" commands (linux/ethtool.h); each takes struct ethtool_value {cmd, data}.
ETHTOOL_SET = {"tx-checksum": 0x17, "sg": 0x19, "tso": 0x1F, "gso": 0x24, "gro": 0x2C}
FRAME_MAX = 65536
PORT_BUFFER = 16 << 20  # bytes of each port's receive buffer
SOL_PACKET, PACKET_STATISTICS = 263, 6  # linux/if_packet.h: struct tpacket_stats {packets, drops}
SO_RCVBUFFORCE = 33  # asm-generic/socket.h: SO_RCVBUF past net.core.rmem_max (root); not in socket
IDLE = 1.0  # seconds between looks at the stop flag when nothing is queued


def offloads_off(ifname: str) -> None:
    """Turn off tx checksum, scatter-gather, TSO, GSO and GRO on ``ifname`` (this namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name, cmd in ETHTOOL_SET.items():
            value = array.array("I", [cmd, 0])
            address, _ = value.buffer_info()
            ifreq = struct.pack("16sP", ifname.encode(), address)
            try:
                fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)
            except OSError as exc:
                raise SystemExit(f"switch: cannot turn {name} off on {ifname}: {exc}") from None


class Switch:
    def __init__(self, ports: list[str], delay: float, loss: float, seed: int, queue: int) -> None:
        self.delay = delay
        self.loss = loss
        self.rng = random.Random(seed)
        self.limit = queue
        self.socks: dict[int, socket.socket] = {}
        self.names: dict[int, str] = {}
        for name in ports:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, PORT_BUFFER)
            sock.bind((name, 0))
            sock.setblocking(False)
            self.socks[sock.fileno()] = sock
            self.names[sock.fileno()] = name
        self.queues: dict[int, collections.deque[tuple[float, bytes]]] = {
            fd: collections.deque() for fd in self.socks
        }
        self.where: dict[bytes, int] = {}  # source MAC -> port it was last seen on
        self.counts = dict.fromkeys(("forwarded", "lost", "overflow", "oversize", "errors"), 0)
        self.running = True

    def receive(self, fd: int, now: float) -> None:
        sock = self.socks[fd]
        for _ in range(256):  # a burst at most, then let the sender side run
            try:
                frame, address = sock.recvfrom(FRAME_MAX)
            except BlockingIOError:
                return
            if address[2] == socket.PACKET_OUTGOING:  # our own send, seen by our own socket
                continue
            if len(frame) < 14:
                continue
            self.where[frame[6:12]] = fd
            if self.loss and self.rng.random() < self.loss:
                self.counts["lost"] += 1
                continue
            out = self.where.get(frame[0:6])
            targets = [out] if out is not None and not frame[0] & 1 else list(self.socks)
            for target in targets:
                if target == fd:
                    continue
                queue = self.queues[target]
                if len(queue) >= self.limit:
                    self.counts["overflow"] += 1
                    continue
                queue.append((now + self.delay, frame))

    def send_due(self, now: float) -> float | None:
        """Send what is due; the seconds until the next frame is due, None when all are empty."""
        wait: float | None = None
        for fd, queue in self.queues.items():
            sock = self.socks[fd]
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                try:
                    sock.send(frame)
                    self.counts["forwarded"] += 1
                except BlockingIOError:
                    queue.appendleft((now, frame))  # the port is busy: retry shortly
                    break
                except OSError:
                    key = "oversize" if len(frame) > 1514 else "errors"
                    self.counts[key] += 1
            if queue:
                left = max(queue[0][0] - now, 0.0)
                wait = left if wait is None else min(wait, left)
        return wait

    def serve(self) -> None:
        # select() takes its timeout in microseconds (poll() in whole milliseconds, which would
        # add up to a millisecond to every frame's delay); a switch has few ports
        fds = list(self.socks)
        print("ready", flush=True)
        wait: float | None = None
        while self.running:
            timeout = IDLE if wait is None else min(wait, IDLE)
            try:
                readable, _, _ = select.select(fds, [], [], timeout)
            except InterruptedError:
                continue
            now = time.monotonic()
            for fd in readable:
                self.receive(fd, now)
            wait = self.send_due(time.monotonic())

    def stop(self, signum: int, frame: FrameType | None) -> None:
        self.running = False

    def unread(self) -> int:
        """Frames the kernel dropped on the ports since they opened (read once, at the end)."""
        stats = (s.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8) for s in self.socks.values())
        return sum(struct.unpack("II", raw)[1] for raw in stats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", action="append", default=[], help="an interface to switch")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="delay of every frame")
    parser.add_argument("--loss", type=float, default=0.0, help="drop probability, 0..1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the loss RNG")
    parser.add_argument("--queue", type=int, default=10000, help="frames per port queue")
    parser.add_argument("--offloads-off", metavar="IFNAME", action="append", default=[])
    args = parser.parse_args()
    if args.offloads_off:
        for name in args.offloads_off:
            offloads_off(name)
        return 0
    if not 0.0 <= args.loss < 1.0 or args.delay_ms < 0 or len(args.port) < 2:
        parser.error("need two --port or more, --delay-ms >= 0 and 0 <= --loss < 1")
    switch = Switch(args.port, args.delay_ms / 1000.0, args.loss, args.seed, args.queue)
    signal.signal(signal.SIGTERM, switch.stop)
    signal.signal(signal.SIGINT, switch.stop)
    switch.serve()
    switch.counts["unread"] = switch.unread()
    print(" ".join(f"{k}={v}" for k, v in switch.counts.items()), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
