"""What the coordinator spends on a retried hello: decoded in full against known by its bytes.

    python bench/hello_retry.py [--params 320] [--repeat 200]

A worker re-sends its hello unchanged until it is answered (0.1 s, doubling), so at a thousand
workers the coordinator reads several hellos per worker. This times, on one coordinator with one
member whose model has ``--params`` parameters (since protocol 5 the hello carries only their
digest and count), the handling of that member's retried hello:

- ``decoded``: the frame decoded in full, then judged by the run's machine, which is what every
  retried hello cost before the retries were known by their bytes;
- ``known``: the service's handling of the same frame (``Intake.receive``, where the service
  hands it every frame), which knows it by the digest of its bytes and hands the machine the
  hello it decoded the first time.

Also times ``first``: the service's handling of a first hello (a new worker each time, on a
coordinator that waits for a million): what admitting one worker costs, Joined included.
Prints microseconds per hello, best of 15 rounds, and the ratio decoded / known.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from codec import fingerprint, per_call  # bench/codec.py, beside this script

from epochal.coordinator import Coordinator, CoordinatorConfig
from epochal.coordinator.rules.actions import Send
from epochal.protocol import Hello, Joined, encode
from epochal.protocol.codec import decode_frame


def hello(params: int) -> Hello:
    return Hello(
        job="epochal",
        token="s3cret",
        worker_id="w-1",
        host="node1",
        pid=4242,
        rank_hint=None,
        device="cuda",
        fingerprint=fingerprint(params),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=320, help="parameters of the model")
    parser.add_argument("--repeat", type=int, default=200, help="retries per round")
    args = parser.parse_args()
    coordinator = Coordinator(CoordinatorConfig(world_size=2, epochs=1, token="s3cret"))
    coordinator._load()  # the machine, without a socket: frames are handed in
    machine = coordinator.machine
    peer = b"worker-1"
    data = encode(hello(args.params))
    first = coordinator._intake.receive([peer, data], time.monotonic())  # admitted: now a member
    assert any(isinstance(a, Send) and isinstance(a.message, Joined) for a in first)

    def decoded() -> object:
        got = decode_frame(data)
        return machine.on_message(time.monotonic(), peer, got.message, session=got.session)

    def known() -> object:
        return coordinator._intake.receive([peer, data], time.monotonic())

    assert decoded() == known()  # the same answer: Joined again
    slow = per_call(decoded, args.repeat)
    fast = per_call(known, args.repeat)
    many = Coordinator(CoordinatorConfig(world_size=1_000_000, epochs=1, token="s3cret"))
    many._load()
    template = hello(args.params)
    frames = iter(  # encoded beforehand: only their handling is timed
        [
            (f"worker-{n}".encode(), encode(dataclasses.replace(template, worker_id=f"w{n}")))
            for n in range(15 * args.repeat)
        ]
    )

    def first() -> object:
        peer, frame = next(frames)
        return many._intake.receive([peer, frame], time.monotonic())

    admit = per_call(first, args.repeat)
    print(f"retried hello with {args.params} params ({len(data)} bytes):")
    print(f"  decoded in full    {slow:10.1f} µs")
    print(f"  known by its bytes {fast:10.1f} µs")
    print(f"  ratio              {slow / fast:10.0f}x")
    print(f"first hello, admitted {admit:8.1f} µs")


if __name__ == "__main__":
    main()
