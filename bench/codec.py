"""What decoding one control frame costs, per message type and on hostile frames.

    python bench/codec.py [--repeat 2000] [--params 1000]

Typical frames: for one example of every registered message type it times
:func:`epochal.protocol.decode` and, in the same run on the same bytes, ``msgpack.unpackb``
(which checks nothing and bounds nothing): the ratio is what the typed, bounded decoding costs.
Also times the first page of a model of ``--params`` parameters (as many as fit in a frame). The
examples below are typical frames of a run; a message type without one here (a new message) is
timed on the first example ``tests/protocol/examples.py`` derives from its declared fields, so a
new message needs nothing in this file.

Hostile frames (:func:`hostile`): the frames a peer outside the run can make the coordinator
decode, each as large as a frame may be: hellos whose unknown trailing field is as dense as
msgpack allows (an empty list, an empty map or a small int per byte), hellos at their longest
legal strings, a frame nested as deep as it can be, junk. For each it prints nanoseconds per byte
(what the strangers' budget must pay for); the worst of them is the decoder's worst case, which
docs/protocol.md states. Decoding any of them through :func:`epochal.protocol.decode`, whatever
``epochal`` is importable, so the same file measures another version of the codec (``PYTHONPATH``).

Prints best of 15 rounds (the round least disturbed by other processes).
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from epochal.errors import EpochalError
from epochal.protocol import decode, encode
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_NAME_CHARS,
    MESSAGE_TYPES,
    Abort,
    Checkpointed,
    Decision,
    DescribeModel,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    Fingerprint,
    Finish,
    Go,
    Heartbeat,
    Hello,
    Joined,
    Liveness,
    ModelPage,
    OpenStore,
    ParamSpec,
    Reject,
    Status,
    StoreReady,
    Welcome,
)
from epochal.protocol.paging import model_page

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests/
from tests.protocol.examples import examples as derived


def params(n: int) -> tuple[ParamSpec, ...]:
    """A model's ``n`` entries, as a worker describes them."""
    return tuple(ParamSpec(f"layer{i}.weight", (512, 512, 3, 3), "float32") for i in range(n))


def fingerprint(n: int) -> Fingerprint:
    """The fingerprint a hello carries for a model of ``n`` entries."""
    return Fingerprint(digest="d" * 64, torch_version="2.4.0", entries=n)


def examples(n: int) -> dict[str, Any]:
    def hello(n: int) -> Hello:
        return Hello(
            job="epochal",
            token="s3cret",
            worker_id="w-1",
            host="node1",
            pid=4242,
            rank_hint=1,
            device="cuda",
            fingerprint=fingerprint(n),
        )

    session = "s" * 43
    out: dict[str, Any] = {
        "hello": hello(3),
        "store_ready": StoreReady(host="10.0.0.1", port=29500, key="9f2c" * 8),
        "epoch_ready": EpochReady(epoch=3, train_batches=48, valid_batches=None),
        "epoch_report": EpochReport(  # as every epoch but the last sends it: with the next counts
            epoch=3,
            train_loss_sum=12.5,
            train_count=100,
            valid_loss_sum=0.0,
            valid_count=0,
            ready=EpochReady(epoch=4, train_batches=48, valid_batches=None),
        ),
        "checkpointed": Checkpointed(epoch=2),
        "failed": Failed(reason="ValueError: boom"),
        "done": Done(),
        "heartbeat": Heartbeat(),
        "status": Status(phase="train", epoch=3, step=17, where="train.py:168 in train_epoch"),  # type: ignore[arg-type]
        "joined": Joined(joined=2, world_size=4, session=session, liveness=Liveness()),
        "open_store": OpenStore(run_id="run-1"),
        "welcome": Welcome(
            rank=3,
            world_size=4,
            run_id="run-1",
            backend="nccl",
            store_host="10.0.0.1",
            store_port=29500,
            start_epoch=3,
            epochs=10,
            resume_epoch=2,
            checkpoint_dir="/runs/a/checkpoints",
            session=session,
            liveness=Liveness(),
            store_key="9f2c" * 8,
        ),
        "reject": Reject(reason="surplus", code="refused"),
        "go": Go(epoch=0, train_batches=48, valid_batches=0, lr_factor=0.5),
        "decision": Decision(
            epoch=2,
            train_loss=0.25,
            valid_loss=None,
            smoothed_loss=None,
            best_epoch=None,
            is_best=False,
            checkpoint=True,
            stop=False,
            go=Go(epoch=3, train_batches=48, valid_batches=0, lr_factor=0.5),  # the run goes on
        ),
        "finish": Finish(best_epoch=1, best_loss=0.125, epochs_run=3, restore_best=True),
        "abort": Abort(reason="rank 1 failed"),
        "describe_model": DescribeModel(first=0),
        "model_page": ModelPage(first=0, entries=3, params=params(3)),
    }
    for name in sorted(set(MESSAGE_TYPES) - set(out)):  # a message with no typical frame above
        out[name] = derived(MESSAGE_TYPES[name])[0]
    page = model_page(params(n), 0)
    out[f"model_page ({len(page.params)} params)"] = page
    return out


def per_call(fn: Callable[[], Any], repeat: int) -> float:
    """Microseconds per call, best of 15 rounds of ``repeat`` calls (the best round is the one
    least disturbed by other processes)."""
    # the garbage collector on, as in the coordinator: a frame that builds many containers pays
    # for the collections it sets off
    return min(timeit.repeat(fn, "gc.enable()", number=repeat, repeat=15)) / repeat * 1e6


def _hello_frame(**changes: Any) -> dict[str, Any]:
    hello = examples(3)["hello"]
    frame = msgpack.unpackb(encode(hello), raw=False)
    frame.update(changes)
    return frame


def _later(frame: dict[str, Any]) -> bytes:
    """``frame`` packed with one more entry begun: the key ``later`` (a field this version does
    not know), its value to follow."""
    packed = msgpack.packb(frame, use_bin_type=True)
    entries = len(frame) + 1
    header = bytes([0x80 | entries]) if entries < 16 else b"\xde" + entries.to_bytes(2, "big")
    return header + packed[1 if len(frame) < 16 else 3 :] + msgpack.packb("later")


def _fill(frame: dict[str, Any], item: bytes) -> bytes:
    """``frame`` with a last field ``later`` (a field this version does not know) holding as many
    copies of the msgpack value ``item`` as fit in a frame."""
    head = _later(frame)
    count = min((MAX_FRAME_BYTES - len(head) - 5) // len(item), 0xFFFF)
    return head + b"\xdc" + count.to_bytes(2, "big") + item * count


def largest_hello(worker_id: str = "flood") -> bytes:
    """The largest well-formed hello a peer outside the run can send (its token guessed): its
    fingerprint is valid, and a field this version does not know lists every parameter entry that
    fits, as fingerprints did when they travelled whole and took seconds to decode."""
    entry = {"name": "encoder.layers.0.attention.weight", "shape": [1024, 1024], "dtype": "f"}
    fields = _hello_frame(token="guessed", worker_id=worker_id)
    room = MAX_FRAME_BYTES - len(msgpack.packb(fields)) - 64
    fields["params"] = [entry] * (room // len(msgpack.packb(entry)))
    frame: bytes = msgpack.packb(fields)
    assert len(frame) <= MAX_FRAME_BYTES
    return frame


def hostile() -> dict[str, bytes]:
    """The frames a peer outside the run can send, each as large as a frame may be."""
    longest = "\U0001f600" * MAX_NAME_CHARS  # a name at its longest, in four-byte characters
    strings = _hello_frame(job="a" * MAX_NAME_CHARS, token=longest, worker_id=longest)
    deep = _later(_hello_frame())
    deep += b"\x91" * (MAX_FRAME_BYTES - len(deep) - 1) + b"\x90"
    return {
        "largest hello": largest_hello(),
        "dense empty lists": _fill(_hello_frame(), b"\x90"),
        "dense empty maps": _fill(_hello_frame(), b"\x80"),
        "dense small ints": _fill(_hello_frame(), b"\x01"),
        "dense nil": _fill(_hello_frame(), b"\xc0"),
        "lists of lists": _fill(_hello_frame(), b"\x9f" + b"\x90" * 15),
        "nested empty lists": _fill(_hello_frame(), b"\xdc\x10\x00" + b"\x90" * 4096),
        "short strings": _fill(_hello_frame(), b"\xa1x"),
        "deep nesting": deep,
        "longest strings": _fill(strings, b"\x90"),
        "dense, then bad type": _fill(_hello_frame(pid="x"), b"\x90"),
        "not msgpack": b"\xc1" * MAX_FRAME_BYTES,
        "a list, not a map": b"\xdc"
        + (MAX_FRAME_BYTES - 4).to_bytes(2, "big")
        + b"\x90" * (MAX_FRAME_BYTES - 4),
    }


def _decode_or_refuse(data: bytes) -> None:
    try:
        decode(data)
    except EpochalError:  # MalformedMessage, ProtocolVersionMismatch: what a refusal is
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1000, help="calls per round (small frames)")
    parser.add_argument("--params", type=int, default=1000, help="parameters of the large page")
    args = parser.parse_args()
    print(f"{'message':<22}{'bytes':>8}{'decode µs':>12}{'unpackb µs':>12}{'ratio':>8}")
    ratios = []
    for name, message in examples(args.params).items():
        data = encode(message)
        assert decode(data) == message
        repeat = max(args.repeat * 200 // max(len(data), 200), 5)
        ours = per_call(lambda data=data: decode(data), repeat)  # type: ignore[misc]
        plain = per_call(lambda data=data: msgpack.unpackb(data, raw=False), repeat)  # type: ignore[misc]
        ratio = ours / plain
        if "params" not in name:
            ratios.append(ratio)
        print(f"{name:<22}{len(data):>8}{ours:>12.2f}{plain:>12.2f}{ratio:>8.1f}")
    ratios.sort()
    print(f"small frames: ratio median {ratios[len(ratios) // 2]:.1f}, max {ratios[-1]:.1f}")
    print()
    print(f"{'hostile frame':<22}{'bytes':>8}{'decode µs':>12}{'ns/byte':>10}")
    worst = ("", 0.0)
    for name, data in hostile().items():
        assert len(data) <= MAX_FRAME_BYTES, name
        ours = per_call(lambda data=data: _decode_or_refuse(data), 20)  # type: ignore[misc]
        per_byte = ours * 1000 / len(data)
        worst = max(worst, (name, per_byte), key=lambda w: w[1])
        print(f"{name:<22}{len(data):>8}{ours:>12.1f}{per_byte:>10.1f}")
    print(f"worst case: {worst[1]:.1f} ns a byte ({worst[0]})")


if __name__ == "__main__":
    main()
