"""What decoding one control frame costs, per message type, against plain ``msgpack.unpackb``.

    python bench/codec.py [--repeat 2000] [--params 1000]

For one example of every registered message type it times :func:`epochal.protocol.decode`
and, in the same run on the same bytes, ``msgpack.unpackb`` (which checks nothing and bounds
nothing): the ratio is what the field-by-field, bounded validation costs. Also times the first
page of a model of ``--params`` parameters (as many as fit in a frame). Prints microseconds per
frame, best of 15 rounds. The examples below are typical frames of a run; a message type without
one here (a new message) is timed on the first example ``tests/protocol/examples.py`` derives
from its declared fields, so a new message needs nothing in this file.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from epochal.protocol import decode, encode
from epochal.protocol.messages import (
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
    return min(timeit.repeat(fn, number=repeat, repeat=15)) / repeat * 1e6


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


if __name__ == "__main__":
    main()
