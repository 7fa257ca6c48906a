"""The codec turns any bytes into exactly one message or a MalformedMessage that says what is wrong.

Round trips for every registered message type (examples derived from its declared fields, see
tests/protocol/examples.py, and hypothesis-built ones), one rejection case per rule (mutating a few
hand-built messages), and property tests that feed decode arbitrary bytes, arbitrary msgpack
objects and mutations of valid frames. Versions (a newer or older minor's frames, another major's)
are tests/protocol/test_versions.py's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from epochal.errors import EpochalError, MalformedMessage, ProtocolVersionMismatch
from epochal.protocol import decode, encode
from epochal.protocol.codec import Decoded, decode_frame
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_METRICS,
    MAX_PAGE_PARAMS,
    MAX_TEXT_CHARS,
    MESSAGE_TYPES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    TYPE_NAMES,
    Abort,
    Awaiting,
    Chars,
    Checkpointed,
    Decision,
    Done,
    EpochReady,
    EpochReport,
    Failed,
    FieldSpec,
    Fingerprint,
    Finish,
    Finite,
    Ge,
    Go,
    Heartbeat,
    Hello,
    Joined,
    Length,
    Liveness,
    Metric,
    MetricName,
    ModelPage,
    OneOf,
    ParamSpec,
    Phase,
    Reject,
    Status,
    StoreReady,
    Welcome,
    Within,
    check_job_name,
    clip,
    fields_of,
)
from tests.protocol.examples import examples

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(max_examples=300, deadline=None)

FINGERPRINT = Fingerprint(digest="d" * 64, torch_version="2.4.0", entries=3)

PARAMS = (
    ParamSpec(name="weight", shape=(2, 5), dtype="torch.float32"),
    ParamSpec(name="bias", shape=(2,), dtype="torch.float32"),
    ParamSpec(name="scalar", shape=(), dtype="torch.int64"),
)

# Hand-built messages the rejection tests below mutate, with values their expected refusals name;
# the round trips cover every registered message with examples derived from its declared fields.
HAND_BUILT: dict[type, Any] = {
    Hello: Hello(
        job="epochal",
        token="s3cret",
        worker_id="w-1",
        host="node1",
        pid=4242,
        rank_hint=1,
        device="cuda",
        fingerprint=FINGERPRINT,
    ),
    StoreReady: StoreReady(host="10.0.0.1", port=29500, key="9f2c" * 8),
    EpochReady: EpochReady(epoch=3, train_batches=48, valid_batches=None),
    EpochReport: EpochReport(
        epoch=3,
        train_loss_sum=12.5,
        train_count=100,
        valid_loss_sum=0.0,
        valid_count=0,
        train_metrics=(Metric(name="accuracy", total=91.0, count=100),),
        ready=EpochReady(epoch=4, train_batches=48, valid_batches=None),
    ),
    Failed: Failed(reason="ValueError: boom"),
    Done: Done(),
    Heartbeat: Heartbeat(),
    Status: Status(phase="train", epoch=3, step=17, where="train.py:168 in train_epoch"),
    Joined: Joined(joined=2, world_size=4, session="s" * 43, liveness=Liveness()),
    Welcome: Welcome(
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
        session="s" * 43,
        liveness=Liveness(interval=0.5, timeout=5.0),
        store_key="9f2c" * 8,
    ),
    Reject: Reject(reason="surplus", code="refused"),
    Go: Go(epoch=0, train_batches=48, valid_batches=0, lr_factor=0.5),
    Decision: Decision(
        epoch=2,
        train_loss=0.25,
        valid_loss=None,
        smoothed_loss=None,
        best_epoch=None,
        is_best=False,
        checkpoint=True,
        stop=True,
        valid_metrics=(Metric("accuracy", 180.0, 200), Metric("top_5", 199.0, 200)),
    ),
    Finish: Finish(best_epoch=1, best_loss=0.125, epochs_run=3, restore_best=True),
    Checkpointed: Checkpointed(epoch=2),
    ModelPage: ModelPage(first=0, entries=3, params=PARAMS),
}


MINOR = {"m": PROTOCOL_MINOR} if PROTOCOL_MINOR else {}
"""What a frame of this version carries besides ``v`` and ``t``: its minor version, left out when
0."""


def frame_of(message: Any) -> dict[str, Any]:
    """The plain map a message travels as (to mutate and re-pack)."""
    frame = msgpack.unpackb(encode(message), raw=False)
    assert isinstance(frame, dict)
    return frame


def pack(frame: Any) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def refusal(data: bytes) -> str:
    """Decode ``data``, which must be refused; return the refusal's message."""
    with pytest.raises(MalformedMessage) as info:
        decode(data)
    return str(info.value)


# ----------------------------------------------------------------------------- strategies

INT64 = 2**63 - 1
nonneg = st.integers(0, INT64)
text = st.text(max_size=24)
nonempty = st.text(min_size=1, max_size=24)
no_nan = st.floats(allow_nan=False)
finite = st.floats(allow_nan=False, allow_infinity=False)

param_specs = st.builds(
    ParamSpec,
    name=nonempty,
    shape=st.lists(st.integers(0, 2**40), max_size=6).map(tuple),
    dtype=nonempty,
)


sessions = st.text(min_size=1, max_size=64)


@st.composite
def joineds(draw: st.DrawFn) -> Joined:
    world_size = draw(st.integers(1, 2**31))
    return Joined(
        joined=draw(st.integers(1, world_size)),
        world_size=world_size,
        session=draw(sessions),
        liveness=draw(livenesses()),
    )


@st.composite
def livenesses(draw: st.DrawFn) -> Liveness:
    interval = draw(st.floats(min_value=1e-3, max_value=1e6))
    return Liveness(interval=interval, timeout=draw(st.floats(interval * 1.001, 1e7)))


@st.composite
def welcomes(draw: st.DrawFn) -> Welcome:
    world_size = draw(st.integers(1, 2**31))
    resume = draw(st.none() | nonneg)
    return Welcome(
        rank=draw(st.integers(0, world_size - 1)),
        world_size=world_size,
        run_id=draw(nonempty),
        backend=draw(st.sampled_from(["gloo", "nccl"])),
        store_host=draw(nonempty),
        store_port=draw(st.integers(1, 65535)),
        start_epoch=draw(nonneg),
        epochs=draw(st.integers(1, INT64)),
        resume_epoch=resume,
        checkpoint_dir=draw(nonempty) if resume is not None else draw(text),
        session=draw(sessions),
        liveness=draw(livenesses()),
        store_key=draw(text),
    )


@st.composite
def model_pages(draw: st.DrawFn) -> ModelPage:
    """A page of entries from ``first`` on, within the count of a model's entries."""
    params = tuple(draw(st.lists(param_specs, max_size=4)))
    first = draw(st.integers(0, 10**6))
    entries = draw(st.integers(first + len(params), 10**7))
    return ModelPage(first=first, entries=entries, params=params)


@st.composite
def statuses(draw: st.DrawFn) -> Status:
    phase = draw(st.sampled_from([p.value for p in Phase]))
    waiting = phase == Phase.WAITING
    return Status(
        phase=phase,
        epoch=draw(nonneg),
        step=draw(nonneg),
        where=draw(text),
        awaiting=draw(st.sampled_from([a.value for a in Awaiting])) if waiting else None,
    )


# Records whose fields depend on each other (or, for ParamSpec, whose list items are bounded)
# have their strategy written out; every other message's is derived from its declared fields.
metric_names = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,63}", fullmatch=True).filter(
    lambda name: name not in ("loss", "batches")
)


@st.composite
def epoch_reports(draw: st.DrawFn) -> EpochReport:
    """A report, with or without the next epoch's counts (``ready``: for ``epoch`` + 1)."""
    values = {f.name: draw(field_values(f)) for f in fields_of(EpochReport) if f.name != "ready"}
    epoch = values["epoch"] = draw(st.integers(0, INT64 - 1))
    ready = draw(st.none() | record_values(EpochReady))
    if ready is not None:
        ready = dataclasses.replace(ready, epoch=epoch + 1)
    return EpochReport(**values, ready=ready)


@st.composite
def decisions(draw: st.DrawFn) -> Decision:
    """A decision that stops, one that gathers, or one that carries the next epoch's go."""
    values = {f.name: draw(field_values(f)) for f in fields_of(Decision) if f.name != "go"}
    epoch = values["epoch"] = draw(st.integers(0, INT64 - 1))
    values["gather"] = values["gather"] and not values["stop"]
    go = None
    if not values["stop"] and not values["gather"]:
        go = dataclasses.replace(draw(record_values(Go)), epoch=epoch + 1)
    return Decision(**values, go=go)


WRITTEN_OUT: dict[type, st.SearchStrategy[Any]] = {
    ParamSpec: param_specs,
    Metric: st.builds(Metric, name=metric_names, total=no_nan, count=nonneg),
    Joined: joineds(),
    Welcome: welcomes(),
    Status: statuses(),
    EpochReport: epoch_reports(),
    Decision: decisions(),
    ModelPage: model_pages(),
}


def field_values(spec: FieldSpec) -> st.SearchStrategy[Any]:
    """Valid values of a field, from what its type declares (as a caller passes them: strings
    for closed sets)."""
    values = _plain_values(spec)
    return st.none() | values if spec.nilable else values


def _plain_values(spec: FieldSpec) -> st.SearchStrategy[Any]:
    choices = [c.choices for c in spec.constraints if isinstance(c, OneOf)]
    if choices:
        return st.sampled_from([member.value for member in choices[0]])
    if spec.kind is int:
        least, most = -(2**63), INT64
        for c in spec.constraints:
            if isinstance(c, Ge):
                least = c.least
            elif isinstance(c, Within):
                least, most = c.lowest, c.highest
        return st.integers(least, most)
    if spec.kind is float:
        return finite if any(isinstance(c, Finite) for c in spec.constraints) else no_nan
    if spec.kind is bool:
        return st.booleans()
    if spec.kind is str and any(isinstance(c, MetricName) for c in spec.constraints):
        return metric_names
    if spec.kind is str:
        least, most = 0, 24
        for c in spec.constraints:
            if isinstance(c, Chars):
                least = 0 if c.empty else 1
            elif isinstance(c, Length):
                least, most = c.least, c.most
        return st.text(min_size=least, max_size=most)
    if spec.kind is tuple:
        assert spec.item is not None
        unique = (lambda m: m.name) if spec.item.kind is Metric else None
        return st.lists(field_values(spec.item), max_size=4, unique_by=unique).map(tuple)
    return record_values(spec.kind)


def record_values(cls: type) -> st.SearchStrategy[Any]:
    if cls in WRITTEN_OUT:
        return WRITTEN_OUT[cls]
    return st.builds(cls, **{spec.name: field_values(spec) for spec in fields_of(cls)})


STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    cls: record_values(cls) for cls in MESSAGE_TYPES.values()
}
messages = st.one_of(*STRATEGIES.values())

# Anything msgpack can pack, including what decode must refuse (int keys, bin, deep nesting).
msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=8)
    | st.sampled_from([0, 1, -1, 65535, 65536, "cpu", "cuda", "gloo", "nccl", "", 1.5])
)
msgpack_objects = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-2, 2), children, max_size=4)
    ),
    max_leaves=16,
)

ALL_FIELDS = sorted(
    {f.name for cls in MESSAGE_TYPES.values() for f in dataclasses.fields(cls)}
    | {f.name for cls in (Fingerprint, ParamSpec, Metric) for f in dataclasses.fields(cls)}
)
small_objects = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from([*ALL_FIELDS, "x"]), children, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def near_frames(draw: st.DrawFn) -> dict[str, Any]:
    """Frames that get past the version and type checks, each declared field usually present and
    holding either its value from a valid message or an arbitrary object, sometimes an extra field:
    this is what exercises the field-by-field checks."""
    valid = frame_of(draw(messages))
    frame = {"v": valid.pop("v"), "t": valid.pop("t")}
    for name, value in valid.items():
        if draw(st.integers(0, 9)) == 0:
            continue  # missing
        frame[name] = value if draw(st.booleans()) else draw(small_objects)
    if draw(st.integers(0, 9)) == 0:
        frame[draw(st.sampled_from(ALL_FIELDS))] = draw(small_objects)
    return frame


def decodes_or_refuses(data: bytes) -> Any:
    """The codec's contract: a message of a known type, or MalformedMessage; nothing else."""
    try:
        message = decode(data)
    except MalformedMessage as exc:
        assert str(exc), "a refusal must say what is wrong"
        return None
    assert type(message) in TYPE_NAMES
    # whatever decode accepts, encode can send again, unchanged
    again = encode(message)
    assert encode(decode(again)) == again
    return message


# ----------------------------------------------------------------------------- round trips


def test_every_registered_message_has_derived_examples_and_a_strategy():
    for cls in MESSAGE_TYPES.values():
        assert examples(cls), TYPE_NAMES[cls]
    assert set(STRATEGIES) == set(MESSAGE_TYPES.values())
    assert set(HAND_BUILT) <= set(MESSAGE_TYPES.values())
    assert set(WRITTEN_OUT) <= {*MESSAGE_TYPES.values(), ParamSpec, Fingerprint, Metric}
    assert all(type(m) is cls for cls, m in HAND_BUILT.items())


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=TYPE_NAMES.get)
def test_every_registered_message_round_trips_in_every_example(cls: type):
    """The smallest and largest value of each field, each member of a closed set, nested records:
    every example decodes to itself, with the session and minor version beside it."""
    cases = examples(cls) + ([HAND_BUILT[cls]] if cls in HAND_BUILT else [])
    for message in cases:
        data = encode(message, session="abc")
        assert decode_frame(data) == Decoded(message, "abc", PROTOCOL_MINOR)
        decoded = decode(encode(message))
        assert type(decoded) is cls
        assert decoded == message
        frame = frame_of(message)
        assert frame["v"] == PROTOCOL_VERSION
        assert frame["t"] == TYPE_NAMES[cls]


@ROUND_TRIP
@given(messages)
def test_any_valid_message_round_trips(message: Any):
    decoded = decode(encode(message))
    assert type(decoded) is type(message)
    # equality also catches a list where the message holds a tuple (shape, params)
    assert decoded == message


def test_wire_format_is_a_flat_map_with_version_and_type():
    assert frame_of(StoreReady(host="h", port=5, key="k")) == {
        "v": PROTOCOL_VERSION,
        **MINOR,
        "t": "store_ready",
        "host": "h",
        "port": 5,
        "key": "k",
        "generation": 0,
    }
    assert frame_of(Done()) == {"v": PROTOCOL_VERSION, **MINOR, "t": "done"}
    assert frame_of(HAND_BUILT[Hello])["fingerprint"] == {
        "digest": "d" * 64,
        "torch_version": "2.4.0",
        "entries": 3,
    }
    nested = frame_of(HAND_BUILT[ModelPage])["params"]
    assert nested[0] == {"name": "weight", "shape": [2, 5], "dtype": "torch.float32"}


def test_nested_values_decode_as_tuples_and_dataclasses():
    hello = decode(encode(HAND_BUILT[Hello]))
    assert isinstance(hello, Hello)
    assert isinstance(hello.fingerprint, Fingerprint)
    page = decode(encode(HAND_BUILT[ModelPage]))
    assert isinstance(page, ModelPage)
    assert isinstance(page.params, tuple)
    assert isinstance(page.params[0], ParamSpec)
    assert page.params[0].shape == (2, 5)
    assert page.params[2].shape == ()
    hash(hello)  # frozen and made of tuples: usable as a key
    hash(page)


GOES_ON = Decision(
    epoch=3,
    train_loss=0.5,
    valid_loss=0.25,
    smoothed_loss=0.25,
    best_epoch=3,
    is_best=True,
    checkpoint=False,
    stop=False,
    go=Go(epoch=4, train_batches=48, valid_batches=6, lr_factor=0.5),
)


def test_the_next_epoch_travels_as_a_nested_message_map_on_either_path():
    report = HAND_BUILT[EpochReport]
    assert frame_of(report)["ready"] == {
        "epoch": 4,
        "train_batches": 48,
        "valid_batches": None,
        "generation": 0,
        "snapshots": "whole",
        "gathers": False,
        "pass_batches": None,
        "global_batch": None,
    }
    assert frame_of(GOES_ON)["go"] == {
        "epoch": 4,
        "train_batches": 48,
        "valid_batches": 6,
        "lr_factor": 0.5,
    }
    last = dataclasses.replace(report, ready=None)
    assert frame_of(last)["ready"] is None  # nil, not left out: there is no next epoch
    for message in (report, last, GOES_ON, HAND_BUILT[Decision]):
        data = encode(message, session="abc")
        assert decode(data) == message
        assert decode_frame(data) == Decoded(message, "abc", PROTOCOL_MINOR)
    decoded = decode(encode(GOES_ON))
    assert isinstance(decoded, Decision) and isinstance(decoded.go, Go)


@pytest.mark.parametrize(
    ("cls", "field", "changes", "expected"),
    [
        (
            EpochReport,
            "ready",
            {"epoch": 9},
            "epoch_report: ready is for epoch 9, not the next one (4)",
        ),
        (
            EpochReport,
            "ready",
            {"train_batches": -1},
            "epoch_report.ready: train_batches must be >= 0",
        ),
        (
            EpochReport,
            "ready",
            {"valid_batches": "3"},
            "epoch_report.ready.valid_batches: expected int",
        ),
        (Decision, "go", {"epoch": 3}, "decision: go is for epoch 3, not the next one (4)"),
        (Decision, "go", {"train_batches": 0}, "decision.go: train_batches must be >= 1, got 0"),
        (Decision, "go", {"lr_factor": math.inf}, "decision.go: lr_factor must be finite"),
    ],
)
def test_a_bad_next_epoch_is_refused_naming_its_path(
    cls: type, field: str, changes: dict[str, Any], expected: str
):
    frame = frame_of(HAND_BUILT[EpochReport] if cls is EpochReport else GOES_ON)
    frame[field] |= changes
    assert expected in refusal(pack(frame))
    frame = frame_of(HAND_BUILT[EpochReport] if cls is EpochReport else GOES_ON)
    del frame[field]["epoch"]
    assert f"{TYPE_NAMES[cls]}.{field}: missing epoch" in refusal(pack(frame))


def test_a_decision_carries_a_go_exactly_when_the_run_goes_on_without_gathering():
    exactly = "go is given exactly when the decision neither stops the run nor gathers"
    assert exactly in refusal(pack(frame_of(GOES_ON) | {"go": None}))
    stops = frame_of(HAND_BUILT[Decision])
    assert stops["stop"] and stops["go"] is None
    assert exactly in refusal(pack(stops | {"go": frame_of(GOES_ON)["go"] | {"epoch": 3}}))
    with pytest.raises(ValueError, match="go is given exactly when"):
        dataclasses.replace(GOES_ON, go=None)
    # the ranks gather the state for newcomers before the epoch: its go comes after the growth
    gathers = dataclasses.replace(GOES_ON, go=None, gather=True)
    assert decode(encode(gathers)) == gathers
    assert exactly in refusal(pack(frame_of(GOES_ON) | {"gather": True}))
    assert "a decision that stops the run gathers nothing" in refusal(
        pack(stops | {"gather": True})
    )


def test_an_int_is_accepted_where_a_float_is_expected_and_becomes_a_float():
    frame = frame_of(HAND_BUILT[Decision]) | {"train_loss": 3, "valid_loss": 2}
    decision = decode(pack(frame))
    assert isinstance(decision, Decision)
    assert decision.train_loss == 3.0 and type(decision.train_loss) is float
    assert decision.valid_loss == 2.0 and type(decision.valid_loss) is float


def test_non_finite_losses_travel_where_the_message_allows_them():
    decision = decode(encode(dataclasses.replace(HAND_BUILT[Decision], train_loss=math.nan)))
    assert isinstance(decision, Decision) and math.isnan(decision.train_loss)
    report = EpochReport(
        epoch=0, train_loss_sum=math.inf, train_count=1, valid_loss_sum=-math.inf, valid_count=0
    )
    assert decode(encode(report)) == report


def test_metrics_travel_as_sums_with_counts_and_are_bounded():
    metrics = tuple(Metric(f"m{i}", float(i), i) for i in range(MAX_METRICS))
    report = dataclasses.replace(HAND_BUILT[EpochReport], valid_metrics=metrics)
    assert decode(encode(report)) == report
    frame = frame_of(report)
    frame["valid_metrics"] = [*frame["valid_metrics"], {"name": "more", "total": 1.0, "count": 1}]
    assert f"valid_metrics: expected a list of at most {MAX_METRICS} items" in refusal(pack(frame))


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ([{"name": "loss", "total": 1.0, "count": 1}], "'loss' is reported on its own"),
        ([{"name": "9lives", "total": 1.0, "count": 1}], "metric name '9lives' is not allowed"),
        ([{"name": "acc", "total": 1.0, "count": -1}], "count must be >= 0"),
        ([{"name": "acc", "total": "1", "count": 1}], "train_metrics[0].total"),
        (
            [{"name": "acc", "total": 1.0, "count": 1}, {"name": "acc", "total": 2.0, "count": 1}],
            "train_metrics names a metric twice",
        ),
    ],
)
def test_a_bad_metric_is_refused_naming_it(metrics: list[Any], expected: str):
    frame = frame_of(HAND_BUILT[EpochReport])
    frame["train_metrics"] = metrics
    assert expected in refusal(pack(frame))


def test_longest_allowed_text_round_trips_even_in_four_byte_characters():
    longest = "\U0001f600" * MAX_TEXT_CHARS
    assert decode(encode(Failed(reason=longest))) == Failed(reason=longest)


def test_clip_cuts_long_reasons_to_what_a_message_can_carry():
    assert clip("short") == "short"
    exact = "x" * MAX_TEXT_CHARS
    assert clip(exact) == exact
    cut = clip("y" * (MAX_TEXT_CHARS * 2))
    assert len(cut) == MAX_TEXT_CHARS
    assert cut.endswith(" ...[truncated]")
    assert cut.startswith("yyy")
    assert decode(encode(Abort(reason=cut))) == Abort(reason=cut)
    assert len(clip("z" * 100, limit=40)) == 40


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(TypeError, match="ParamSpec is not a protocol message"):
        encode(PARAMS[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dict is not a protocol message"):
        encode({"t": "done"})  # type: ignore[arg-type]


def test_encode_refuses_a_message_over_the_frame_limit():
    # 100 entries with 1,000-character names: about 100 KB, over the 64 KiB limit (a page the
    # worker builds with model_page never is)
    params = tuple(
        ParamSpec(name=f"{i:03d}" + "p" * 997, shape=(1,), dtype="f") for i in range(100)
    )
    big = ModelPage(first=0, entries=100, params=params)
    with pytest.raises(
        ValueError, match=rf"model_page message is \d+ bytes, over the {MAX_FRAME_BYTES}"
    ):
        encode(big)


# ----------------------------------------------------------------------------- job names


@pytest.mark.parametrize("job", ["epochal", "a", "A0", "run-2024.01_x", "9lives", "j" * 128])
def test_valid_job_names_are_accepted(job: str):
    assert check_job_name(job) == job


@pytest.mark.parametrize(
    "job", ["", "-lead", ".hidden", "_x", "has space", "slash/y", "j" * 129, "caf\u00e9", "a\tb"]
)
def test_invalid_job_names_are_refused_with_what_is_allowed(job: str):
    with pytest.raises(ValueError) as info:
        check_job_name(job)
    assert repr(job) in str(info.value)
    assert "letters, digits" in str(info.value)


@pytest.mark.parametrize("job", ["epochal\n", "a\n"])
def test_a_trailing_newline_is_not_a_valid_job_name(job: str):
    # "$" alone would match before a trailing newline: the whole name must match
    with pytest.raises(ValueError, match="is not allowed"):
        check_job_name(job)


# ----------------------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        encode(HAND_BUILT[Welcome])[:-1],  # cut short
        encode(HAND_BUILT[Heartbeat]) + b"\x00",  # a second object after the frame
        encode(HAND_BUILT[Heartbeat]) * 2,
    ],
    ids=["empty", "reserved-byte", "truncated", "trailing-byte", "two-frames"],
)
def test_bytes_that_are_not_one_msgpack_object_are_refused(data: bytes):
    assert "not a msgpack frame" in refusal(data)


@pytest.mark.parametrize(
    ("obj", "kind"),
    [([1, "t"], "list"), (1, "int"), ("hello", "str"), (None, "NoneType"), (1.5, "float")],
)
def test_a_frame_that_is_not_a_map_is_refused(obj: Any, kind: str):
    assert f"frame: expected a map, got {kind}" in refusal(pack(obj))


def test_binary_and_non_string_keys_are_refused():
    assert "failed.reason: expected str, got bytes" in refusal(
        pack({"v": PROTOCOL_VERSION, "t": "failed", "reason": b"bytes"})
    )
    assert "a field name must be a string, got int" in refusal(
        pack({"v": PROTOCOL_VERSION, "t": "done", 7: 1})
    )


@pytest.mark.parametrize(
    ("cls", "field"),
    [(StoreReady, "port"), (Hello, "fingerprint"), (Decision, "valid_loss"), (Go, "epoch")],
)
def test_a_missing_field_is_named(cls: type, field: str):
    frame = frame_of(HAND_BUILT[cls])
    del frame[field]
    assert f"{TYPE_NAMES[cls]}: missing {field}" in refusal(pack(frame))


def test_an_optional_field_must_still_be_present():
    # None is a value; leaving the key out is not the same thing
    frame = frame_of(HAND_BUILT[EpochReady])
    assert frame["valid_batches"] is None
    del frame["valid_batches"]
    assert "epoch_ready: missing valid_batches" in refusal(pack(frame))


def test_every_missing_field_is_named_at_once():
    message = refusal(pack({"v": PROTOCOL_VERSION, "t": "store_ready"}))
    assert "store_ready: missing host, port" in message


def test_a_missing_nested_field_names_its_path():
    frame = frame_of(HAND_BUILT[Hello])
    del frame["fingerprint"]["digest"]
    assert "hello.fingerprint: missing digest" in refusal(pack(frame))
    frame = frame_of(HAND_BUILT[ModelPage])
    del frame["params"][1]["dtype"]
    assert "model_page.params[1]: missing dtype" in refusal(pack(frame))


@pytest.mark.parametrize("cls", [StoreReady, Done, Hello])
def test_a_field_this_version_does_not_know_is_skipped_and_named(cls: type):
    frame = frame_of(HAND_BUILT[cls]) | {"colour": "blue"}
    assert decode_frame(pack(frame)) == Decoded(
        HAND_BUILT[cls], minor=PROTOCOL_MINOR, skipped=(f"{TYPE_NAMES[cls]}.colour",)
    )


def test_a_nested_field_this_version_does_not_know_is_skipped_and_named_by_its_path():
    frame = frame_of(HAND_BUILT[ModelPage])
    frame["params"][0]["stride"] = [5, 1]
    frame["params"][2]["stride"] = []
    decoded = decode_frame(pack(frame))
    assert decoded == Decoded(
        HAND_BUILT[ModelPage], minor=PROTOCOL_MINOR, skipped=("model_page.params.stride",)
    )
    frame = frame_of(HAND_BUILT[Hello])
    frame["fingerprint"]["params"] = [{"name": "w", "shape": [2], "dtype": "f"}]
    decoded = decode_frame(pack(frame))
    assert decoded == Decoded(
        HAND_BUILT[Hello], minor=PROTOCOL_MINOR, skipped=("hello.fingerprint.params",)
    )


def test_a_missing_field_names_the_unknown_ones_beside_it():
    # a misspelt field is unknown, so it is skipped; the field it meant is then missing
    frame = {"v": PROTOCOL_VERSION, "t": "store_ready", "host": "h", "prt": 80}
    assert "store_ready: missing port (it has 'prt', not fields of this version)" in refusal(
        pack(frame)
    )


WRONG_TYPES = [
    (EpochReady, ("epoch",), True, "epoch_ready.epoch: expected int, got bool"),
    (EpochReady, ("train_batches",), 48.0, "epoch_ready.train_batches: expected int, got float"),
    (EpochReady, ("valid_batches",), "3", "epoch_ready.valid_batches: expected int, got str"),
    (StoreReady, ("port",), "80", "store_ready.port: expected int, got str"),
    (Decision, ("train_loss",), "1.5", "decision.train_loss: expected float, got str"),
    (Decision, ("valid_loss",), False, "decision.valid_loss: expected float, got bool"),
    (Decision, ("is_best",), 1, "decision.is_best: expected bool, got int"),
    (Decision, ("stop",), None, "decision.stop: expected bool, got NoneType"),
    (Go, ("lr_factor",), True, "go.lr_factor: expected float, got bool"),
    (Failed, ("reason",), 7, "failed.reason: expected str, got int"),
    (Failed, ("reason",), None, "failed.reason: expected str, got NoneType"),
    (Hello, ("rank_hint",), "0", "hello.rank_hint: expected int, got str"),
    (Hello, ("fingerprint",), [], "hello.fingerprint: expected a map, got list"),
    (Hello, ("fingerprint",), None, "hello.fingerprint: expected a map, got NoneType"),
    (Hello, ("fingerprint", "entries"), [], "hello.fingerprint.entries: expected int, got list"),
    (ModelPage, ("params",), {}, "model_page.params: expected a list, got dict"),
    (
        ModelPage,
        ("params", 0, "shape"),
        "2x5",
        "model_page.params[0].shape: expected a list, got str",
    ),
    (
        ModelPage,
        ("params", 0, "shape", 1),
        "5",
        "model_page.params[0].shape[1]: expected int, got str",
    ),
    (ModelPage, ("params", 1), "bias", "model_page.params[1]: expected a map"),
]


@pytest.mark.parametrize(
    ("cls", "path", "value", "expected"),
    WRONG_TYPES,
    ids=[e[-1].split(":")[0] + "=" + type(e[2]).__name__ for e in WRONG_TYPES],
)
def test_a_wrong_type_is_named_with_its_path(
    cls: type, path: tuple[Any, ...], value: Any, expected: str
):
    frame = frame_of(HAND_BUILT[cls])
    target: Any = frame
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert expected in refusal(pack(frame))


OUT_OF_RANGE = [
    (EpochReady, {"train_batches": -1}, "epoch_ready: train_batches must be >= 0, got -1"),
    (EpochReady, {"valid_batches": -2}, "epoch_ready: valid_batches must be >= 0, got -2"),
    (EpochReady, {"epoch": -1}, "epoch_ready: epoch must be >= 0, got -1"),
    (EpochReport, {"valid_count": -3}, "epoch_report: valid_count must be >= 0, got -3"),
    (Go, {"train_batches": 0}, "go: train_batches must be >= 1, got 0"),
    (Go, {"valid_batches": -1}, "go: valid_batches must be >= 0, got -1"),
    (Go, {"lr_factor": math.inf}, "go: lr_factor must be finite, got inf"),
    (Go, {"lr_factor": math.nan}, "go: lr_factor must be finite, got nan"),
    (StoreReady, {"port": 0}, "store_ready: port must be in 1..65535, got 0"),
    (StoreReady, {"port": 65536}, "store_ready: port must be in 1..65535, got 65536"),
    (StoreReady, {"host": ""}, "store_ready: host must not be empty"),
    (Welcome, {"store_port": 0}, "welcome: store_port must be in 1..65535, got 0"),
    (Welcome, {"world_size": 0, "rank": 0}, "welcome: world_size must be >= 1, got 0"),
    (Welcome, {"rank": -1}, "welcome: rank -1 outside"),
    (Welcome, {"backend": "mpi"}, "welcome: backend must be one of gloo, nccl; got 'mpi'"),
    (Welcome, {"epochs": 0}, "welcome: epochs must be >= 1, got 0"),
    (Welcome, {"start_epoch": -1}, "welcome: start_epoch must be >= 0, got -1"),
    (Welcome, {"resume_epoch": -1}, "welcome: resume_epoch must be >= 0, got -1"),
    (
        Welcome,
        {"resume_epoch": 1, "checkpoint_dir": ""},
        "welcome: resume_epoch needs a checkpoint_dir",
    ),
    (Checkpointed, {"epoch": -1}, "checkpointed: epoch must be >= 0, got -1"),
    (Reject, {"code": "nope"}, "reject: code must be one of refused, not_member, malformed"),
    (Status, {"phase": "dancing"}, "status: phase must be one of rendezvous, connect"),
    (Status, {"phase": 3}, "status.phase: expected str, got int"),
    (Status, {"step": -1}, "status: step must be >= 0, got -1"),
    (Joined, {"joined": 0}, "joined: joined 0 outside 1..4"),
    (Joined, {"joined": 5}, "joined: joined 5 outside 1..4"),
    (Hello, {"rank_hint": -1}, "hello: rank_hint must be >= 0, got -1"),
    (Hello, {"pid": -1}, "hello: pid must be >= 0, got -1"),
    (Hello, {"device": "tpu"}, "hello: device must be one of cpu, cuda; got 'tpu'"),
    (Hello, {"worker_id": ""}, "hello: worker_id must not be empty"),
    (Hello, {"job": ""}, "hello: job must not be empty"),
    (Decision, {"best_epoch": -1}, "decision: best_epoch must be >= 0, got -1"),
    (Finish, {"epochs_run": -1}, "finish: epochs_run must be >= 0, got -1"),
    (Failed, {"reason": ""}, "failed: reason must not be empty"),
    (
        Failed,
        {"reason": "r" * (MAX_TEXT_CHARS + 1)},
        f"failed: reason is longer than {MAX_TEXT_CHARS} characters",
    ),
]


@pytest.mark.parametrize(
    ("cls", "changes", "expected"), OUT_OF_RANGE, ids=[e[-1][:40] for e in OUT_OF_RANGE]
)
def test_an_out_of_range_value_is_refused_naming_it(
    cls: type, changes: dict[str, Any], expected: str
):
    assert expected in refusal(pack(frame_of(HAND_BUILT[cls]) | changes))


def test_an_empty_token_is_allowed():
    hello = decode(pack(frame_of(HAND_BUILT[Hello]) | {"token": ""}))
    assert isinstance(hello, Hello) and hello.token == ""


def test_a_rank_at_or_over_the_world_size_is_refused_naming_the_valid_ranks():
    message = refusal(pack(frame_of(HAND_BUILT[Welcome]) | {"rank": 4, "world_size": 4}))
    assert "welcome: rank 4 outside" in message
    # the valid ranks are 0..world_size-1, and the message says so
    assert "0..3" in message


@pytest.mark.parametrize(
    ("cls", "path", "value", "expected"),
    [
        (
            ModelPage,
            ("params", 0, "shape"),
            [2, -5],
            "model_page.params[0]: shape of weight has a negative size",
        ),
        (Hello, ("fingerprint", "digest"), "", "hello.fingerprint: digest must not be empty"),
        (
            Hello,
            ("fingerprint", "entries"),
            100_001,
            "hello.fingerprint: entries must be in 0..100000, got 100001",
        ),
    ],
)
def test_a_nested_out_of_range_value_names_its_path(
    cls: type, path: tuple[Any, ...], value: Any, expected: str
):
    frame = frame_of(HAND_BUILT[cls])
    target: Any = frame
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert expected in refusal(pack(frame))


def test_a_page_past_the_models_entries_is_refused():
    frame = frame_of(HAND_BUILT[ModelPage]) | {"first": 1}
    assert "model_page: entries 1..3 are past the 3 the model has" in refusal(pack(frame))


def test_a_shape_with_too_many_dimensions_is_refused():
    frame = frame_of(HAND_BUILT[ModelPage])
    frame["params"][0]["shape"] = [1] * 65
    # refused from the list's header, before any of its items is read
    assert "params[0].shape: expected a list of at most 64 items" in refusal(pack(frame))


@pytest.mark.parametrize("name", ["teleport", "Hello", "", "hello "])
def test_an_unknown_type_name_is_refused(name: str):
    assert f"unknown message type {name!r}" in refusal(pack({"v": PROTOCOL_VERSION, "t": name}))


@pytest.mark.parametrize("name", [None, 5, ["hello"]])
def test_a_type_that_is_not_a_string_is_refused(name: Any):
    frame = {"v": PROTOCOL_VERSION} if name is None else {"v": PROTOCOL_VERSION, "t": name}
    assert "unknown message type" in refusal(pack(frame))


def test_a_frame_over_the_size_limit_is_refused_before_it_is_parsed():
    message = refusal(b"\xc0" * (MAX_FRAME_BYTES + 1))
    assert f"frame of {MAX_FRAME_BYTES + 1} bytes is over the {MAX_FRAME_BYTES} limit" in message


def test_a_frame_at_the_size_limit_is_parsed_not_refused_for_size():
    message = refusal(b"\xc0" * MAX_FRAME_BYTES)
    assert "frame: expected a map, got NoneType" in message
    assert "limit" not in message


@pytest.mark.parametrize("theirs", [0, 1, PROTOCOL_VERSION + 1, 99, "2", None])
def test_another_protocol_version_is_a_version_mismatch(theirs: Any):
    frame = frame_of(HAND_BUILT[Heartbeat])
    if theirs is None:
        del frame["v"]
    else:
        frame["v"] = theirs
    with pytest.raises(ProtocolVersionMismatch) as info:
        decode(pack(frame))
    err = info.value
    assert isinstance(err, MalformedMessage) and isinstance(err, EpochalError)
    assert err.theirs == theirs
    assert err.ours == PROTOCOL_VERSION
    assert f"peer speaks protocol version {theirs!r}" in str(err)
    assert "install the same epochal version" in str(err)


def test_the_version_is_checked_before_the_type_so_new_types_read_as_a_newer_peer():
    with pytest.raises(ProtocolVersionMismatch):
        decode(pack({"v": PROTOCOL_VERSION + 1, "t": "a_type_from_the_future", "x": 1}))


@pytest.mark.parametrize("theirs", [True, 1.0], ids=["bool", "float"])
def test_a_version_of_the_wrong_type_is_refused(theirs: Any):
    # True and 1.0 compare equal to 1, but the version is an int like every other int field
    frame = frame_of(HAND_BUILT[Heartbeat]) | {"v": theirs}
    with pytest.raises(MalformedMessage):
        decode(pack(frame))


# ----------------------------------------------------------------------------- properties


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_are_refused(data: bytes):
    decodes_or_refuses(data)


@FUZZ
@given(msgpack_objects)
def test_arbitrary_msgpack_objects_decode_or_are_refused(obj: Any):
    decodes_or_refuses(pack(obj))


@FUZZ
@given(near_frames())
def test_frames_with_arbitrary_fields_decode_or_are_refused(frame: dict[str, Any]):
    message = decodes_or_refuses(pack(frame))
    if message is not None:
        # accepted only as the named type, with every field it requires, the others skipped
        assert TYPE_NAMES[type(message)] == frame["t"]
        specs = fields_of(type(message))
        assert {f.name for f in specs if f.required} <= set(frame)
        skipped = {path for path in decode_frame(pack(frame)).skipped if path.count(".") == 1}
        unknown = set(frame) - {"v", "t", "m", "s"} - {f.name for f in specs}
        assert {path.split(".")[1] for path in skipped} == unknown


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(encode(draw(messages)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


@FUZZ
@given(byte_mutations())
def test_byte_mutations_of_valid_frames_decode_or_are_refused(data: bytes):
    decodes_or_refuses(data)


@st.composite
def field_mutations(draw: st.DrawFn) -> dict[str, Any]:
    frame = frame_of(draw(messages))
    keys = sorted(frame)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["replace", "delete", "add"]))
        if kind == "add":
            key = draw(st.sampled_from([*ALL_FIELDS, "v", "t", "m", "s", "extra"]))
            frame[key] = draw(msgpack_objects)
            continue
        key = draw(st.sampled_from(keys))
        if kind == "replace":
            frame[key] = draw(msgpack_objects)
        else:
            frame.pop(key, None)
    return frame


@FUZZ
@given(field_mutations())
def test_field_mutations_of_valid_frames_decode_or_are_refused(frame: dict[str, Any]):
    decodes_or_refuses(pack(frame))


def agrees_with_msgpack(data: bytes) -> None:
    """A frame the decoder accepts is one msgpack itself reads as a map whose every field this
    version knows holds what the decoded message holds, and whose version and type are this
    version and the message's: msgspec's reading is held to msgpack's, the library that wrote
    the frames."""
    try:
        decoded = decode_frame(data)
    except (MalformedMessage, ProtocolVersionMismatch):
        return
    try:
        plain = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except UnicodeDecodeError:
        # text that is not UTF-8 inside a field this version skips unread: nothing is built of
        # it; any field the decoder reads is checked as text (its own tests)
        assert decoded.skipped, "the decoder read a field msgpack cannot read as text"
        return
    message = decoded.message
    assert plain["v"] == PROTOCOL_VERSION and plain["t"] == TYPE_NAMES[type(message)]
    assert plain.get("s", "") == decoded.session and plain.get("m", 0) == decoded.minor
    ours = frame_of(message)
    for spec in fields_of(type(message)):
        if spec.name in plain and not isinstance(plain[spec.name], dict | list):
            theirs = plain[spec.name]
            if isinstance(ours[spec.name], float) and type(theirs) is int:
                theirs = float(theirs)  # an integer sent for a float field: read as the nearest
            assert ours[spec.name] == theirs, spec.name
    assert decode(encode(message)) == message


@FUZZ
@given(st.one_of(field_mutations(), near_frames()))
def test_what_the_decoder_accepts_msgpack_reads_alike(frame: dict[str, Any]):
    agrees_with_msgpack(pack(frame))


@FUZZ
@given(byte_mutations())
@example(  # a float field sent as an integer past 2**53: read as the nearest float
    b"\x87\xa1v\x06\xa1t\xa2go\xa1m\x07\xa5epoch\x00\xadtrain_batches\xcf\x00\x00\x00\x01"
    b"\x00\x00\x00\x00\xadvalid_batches\xcf\x00\x00\x00\x01\x00\x00\x00\x00\xa9lr_factor"
    b"\xcfB\xa0\x00\x00\x00\x00\x02\x00"
)
@example(  # text msgpack cannot read, inside a field this version skips unread
    b"\x8e\xa1v\x06\xa1t\xacepoch_report\xa1m\x07\xa5epoch\xcc\x81\xaetrain_loss_sum\xcb"
    + bytes(8)
    + b"\xabtrain_count\x00\xaevalid_loss_sum\xcb"
    + bytes(8)
    + b"\xabvalid_count\x00\xadurain_metrics\x91\x83\xa5name\xa1A\xa5total\xcb"
    + bytes(8)
    + b"\xa5count\x00\xadvalid_metrics\x90\xa5ready\xc0\xa8checksum\xc0\xaageneration\x00"
    + b"\xa2lr\xc0"
)
def test_what_the_decoder_accepts_of_mutated_bytes_msgpack_reads_alike(data: bytes):
    agrees_with_msgpack(data)


@pytest.mark.parametrize(
    "frame",
    [
        {"v": PROTOCOL_VERSION, "t": "failed", "reason": "a", "reason ": "b"},
        {"t": "done", "v": PROTOCOL_VERSION},
        {"v": PROTOCOL_VERSION, "t": "done", "s": "x"},
        {"v": PROTOCOL_VERSION, "t": "done", "s": ""},
        {"v": PROTOCOL_VERSION, "x": 1, "t": "done"},
    ],
)
def test_edge_cases_msgpack_reads_alike(frame: dict[str, Any]):
    agrees_with_msgpack(pack(frame))


def test_a_repeated_key_is_refused_in_the_frame_and_in_a_record():
    # a msgpack map may repeat a key; unpacked whole, the last would silently win
    data = b"\x84\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa1t\xa6failed"
    data += b"\xa6reason\xa1a\xa6reason\xa1b"
    assert "field 'reason' appears twice" in refusal(data)
    nested = frame_of(HAND_BUILT[ModelPage])
    raw = pack(nested)
    once = msgpack.packb("dtype") + msgpack.packb("torch.float32")
    twice = raw.replace(
        b"\x83" + msgpack.packb("name") + msgpack.packb("weight"),
        b"\x84" + msgpack.packb("name") + msgpack.packb("weight") + once,
        1,
    )
    assert twice != raw
    assert "field 'dtype' appears twice" in refusal(twice)


def test_a_status_phase_is_the_shared_enum_on_both_sides():
    status = decode(encode(Status(phase=Phase.CONNECT, epoch=0, step=0, where="")))
    assert isinstance(status, Status) and status.phase is Phase.CONNECT
    assert frame_of(status)["phase"] == "connect"  # a plain string on the wire
    assert Status(phase="train", epoch=0, step=0, where="").phase is Phase.TRAIN  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"phase must be one of rendezvous, connect, .*'trian'"):
        Status(phase="trian", epoch=0, step=0, where="")  # type: ignore[arg-type]
    assert Phase.CONNECT.description == "connecting the data plane"
    assert all(phase.description for phase in Phase)


def test_a_status_says_what_it_awaits_exactly_when_it_waits():
    status = decode(encode(Status(phase="waiting", epoch=1, step=0, where="", awaiting="go")))  # type: ignore[arg-type]
    assert isinstance(status, Status) and status.awaiting is Awaiting.GO
    assert frame_of(status)["awaiting"] == "go"
    for phase, awaiting in (("waiting", None), ("train", "decision")):
        with pytest.raises(ValueError, match="awaiting is given exactly when the phase is waiting"):
            Status(phase=phase, epoch=1, step=0, where="", awaiting=awaiting)  # type: ignore[arg-type]
    frame = frame_of(status)
    frame["awaiting"] = None
    reason = refusal(msgpack.packb(frame))
    assert "awaiting is given exactly when the phase is waiting" in reason
    frame["awaiting"] = "finish"
    reason = refusal(msgpack.packb(frame))
    assert "status: awaiting must be one of go, decision; got 'finish'" in reason


# ----------------------------------------------------------------------------- bombs


def _bombs() -> dict[str, bytes]:
    """Frames at the size limit whose plain decoding would build the largest object graphs."""
    v = bytes([PROTOCOL_VERSION])
    head = b"\x83\xa1v" + v + b"\xa1t\xa6failed\xa6reason"  # {"v":, "t": "failed", "reason": ...
    room = MAX_FRAME_BYTES - len(head) - 16
    wide = b"\xdd" + (room // 1).to_bytes(4, "big")  # array32 of `room` items
    page = frame_of(HAND_BUILT[ModelPage])
    prefix = pack({**{k: page[k] for k in ("v", "t")}})[1:]  # v and t, without the map header
    return {
        # an array of tens of thousands of empty arrays (about 72 bytes of objects a byte)
        "empty-arrays": head + wide + b"\x90" * room,
        "empty-maps": head + wide + b"\x80" * room,
        # the same made of nested arrays, 16 wide, as deep as msgpack lets them go
        "nested-arrays": head + (b"\x9f" + b"\x90" * 15) * (room // 16),
        # maps of empty maps
        "map-of-maps": head + b"\xdf" + (room // 2).to_bytes(4, "big") + b"\xa0\x80" * (room // 2),
        # 3-byte ints: each a 28-byte object once decoded
        "wide-ints": head
        + b"\xdd"
        + (room // 3).to_bytes(4, "big")
        + b"\xcd\x01\x01" * (room // 3),
        # a page whose params list claims far more entries than any page holds
        "params-claim": b"\x85"
        + prefix
        + msgpack.packb("first")
        + b"\x00"
        + msgpack.packb("entries")
        + b"\x00"
        + msgpack.packb("params")
        + b"\xdd\xff\xff\xff\xff"
        + b"\x80" * 1000,
        # an unknown field whose value is a huge structure
        "unknown-field": b"\x84\xa1v" + v + b"\xa1t\xa4done\xa5extra" + wide + b"\x90" * room,
    }


BOMBS = _bombs()


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_bomb_frames_allocate_a_bounded_multiple_of_their_size(name: str):
    import tracemalloc

    data = BOMBS[name]
    assert len(data) <= MAX_FRAME_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(MalformedMessage):
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # plain msgpack decoding of a 16 MiB frame like these builds about a gigabyte; one empty
    # container per byte is the worst a frame within the limit can do (about 72 bytes each)
    assert peak < 128 * MAX_FRAME_BYTES, f"{name}: decoding allocated {peak} bytes at its peak"


def test_a_bomb_inside_a_declared_list_is_refused_at_its_first_item():
    # the one place a long list of maps is legitimate: a page's params; filled with empty maps
    frame = frame_of(HAND_BUILT[ModelPage])
    frame["params"] = [{}] * MAX_PAGE_PARAMS
    with pytest.raises(MalformedMessage, match=r"params\[0\]: missing name, shape, dtype"):
        decode(pack(frame))
    frame["params"] = [{}] * (MAX_PAGE_PARAMS + 1)
    with pytest.raises(MalformedMessage, match=rf"at most {MAX_PAGE_PARAMS} items"):
        decode(pack(frame))


# ----------------------------------------------------------------------------- sessions


def test_a_session_travels_beside_the_message():
    message = HAND_BUILT[Failed]
    assert decode_frame(encode(message, session="abc")) == Decoded(message, "abc", PROTOCOL_MINOR)
    assert decode_frame(encode(message)) == Decoded(message, "", PROTOCOL_MINOR)
    assert decode(encode(message, session="abc")) == message


@pytest.mark.parametrize("session", [5, "", "x" * 65, None])
def test_a_malformed_session_is_refused(session: Any):
    frame = frame_of(HAND_BUILT[Heartbeat]) | {"s": session}
    with pytest.raises(MalformedMessage, match="session"):
        decode(pack(frame))


def test_version_and_type_must_lead_the_frame():
    frame = {"reason": "x", "v": PROTOCOL_VERSION, "t": "failed"}
    with pytest.raises(ProtocolVersionMismatch):
        decode(pack(frame))


def test_subclasses_of_plain_values_travel_as_the_plain_values():
    # torch.__version__ is a str subclass, a numpy float a float subclass: a worker sends both
    class Version(str):
        pass

    class Float(float):
        pass

    fingerprint = Fingerprint(digest="d" * 64, torch_version=Version("2.13.0"), entries=3)
    sent = dataclasses.replace(HAND_BUILT[Hello], fingerprint=fingerprint)
    assert decode(encode(sent)) == sent
    report = dataclasses.replace(HAND_BUILT[EpochReport], train_loss_sum=Float(1.5))
    assert frame_of(report)["train_loss_sum"] == 1.5
    broken = dataclasses.replace(HAND_BUILT[Failed])
    object.__setattr__(broken, "reason", object())  # past the constructor's checks
    with pytest.raises(TypeError, match="a message cannot carry object"):
        encode(broken)
