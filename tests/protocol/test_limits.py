"""Every legitimate message fits in a frame, so the frame limit can be small.

The coordinator's socket refuses frames over MAX_FRAME_BYTES (ZMQ_MAXMSGSIZE), so that a stranger
cannot make it hold or decode anything large. That is only right if no legitimate message is ever
larger: here the largest of each type, every string at its longest in four-byte characters, every
number at its widest, every list at its longest, is encoded with the longest session a worker
presents, and must fit. A model's parameter list travels in pages that model_page builds, each of
which must fit too, whatever the entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from epochal.protocol import decode, encode
from epochal.protocol.limits import LIST_LIMITS
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_NAME_CHARS,
    MAX_PAGE_PARAMS,
    MAX_SESSION_CHARS,
    MAX_SHAPE_DIMS,
    MESSAGE_TYPES,
    TYPE_NAMES,
    Chars,
    Decision,
    EpochReport,
    FieldSpec,
    Ge,
    Hello,
    Joined,
    Length,
    Liveness,
    Metric,
    ModelPage,
    OneOf,
    ParamSpec,
    Status,
    Welcome,
    Within,
    WorkerMessage,
    fields_of,
)
from epochal.protocol.paging import PAGE_BYTES, entry, model_page

WIDE = "\U0001f600"  # four bytes in UTF-8
UINT64 = 2**64 - 1  # the widest integer msgpack packs (9 bytes)


def _largest_value(spec: FieldSpec, owner: type) -> Any:
    choices = [c.choices for c in spec.constraints if isinstance(c, OneOf)]
    if choices:
        return max((member.value for member in choices[0]), key=len)
    if spec.kind is int:
        for c in spec.constraints:
            if isinstance(c, Within):
                return c.highest
        return UINT64 - 1 if any(isinstance(c, Ge) for c in spec.constraints) else -(2**63)
    if spec.kind is float:
        return 1e308
    if spec.kind is bool:
        return True
    if spec.kind is str:
        for c in spec.constraints:
            if isinstance(c, Chars | Length):
                return WIDE * c.most
        raise AssertionError(f"{owner.__name__}.{spec.name}: a string without a bound")
    if spec.kind is tuple:
        assert spec.item is not None
        most = LIST_LIMITS[spec.name]
        if spec.item.kind is Metric:  # names are ASCII, distinct: 64 characters each
            return tuple(Metric(f"m{i:063d}", 1e308, UINT64) for i in range(most))
        if spec.item.kind is int:
            return (UINT64,) * most
        raise AssertionError(f"{owner.__name__}.{spec.name}: pages are model_page's")
    return largest(spec.kind)


def largest(cls: type) -> Any:
    """The largest instance of a record the declared fields allow (fields that depend on each
    other set to agree)."""
    values = {spec.name: _largest_value(spec, cls) for spec in fields_of(cls)}
    if cls is Welcome:
        values["rank"] = values["world_size"] - 1
    if cls is Joined:
        values["joined"] = values["world_size"]
    if cls is Liveness:  # any float takes 9 bytes; the interval must be below the timeout
        values["interval"] = values["timeout"] / 2
    if cls is Status:
        values["phase"], values["awaiting"] = "waiting", "decision"
    if cls is EpochReport:
        values["epoch"] = UINT64 - 2
        values["ready"] = dataclasses.replace(values["ready"], epoch=UINT64 - 1)
    if cls is Decision:
        values["epoch"], values["stop"] = UINT64 - 2, False
        values["go"] = dataclasses.replace(values["go"], epoch=UINT64 - 1)
    return cls(**values)


def frame_size(message: Any) -> int:
    worker = isinstance(message, WorkerMessage) and not isinstance(message, Hello)
    return len(encode(message, session="s" * MAX_SESSION_CHARS if worker else ""))


@pytest.mark.parametrize(
    "cls", [c for c in MESSAGE_TYPES.values() if c is not ModelPage], ids=TYPE_NAMES.get
)
def test_the_largest_message_of_each_type_fits_in_a_frame(cls: type):
    message = largest(cls)
    assert frame_size(message) <= MAX_FRAME_BYTES
    assert decode(encode(message)) == message


LONGEST_ENTRY = ParamSpec(
    name=WIDE * MAX_NAME_CHARS, shape=(UINT64,) * MAX_SHAPE_DIMS, dtype=WIDE * MAX_NAME_CHARS
)
SHORTEST_ENTRY = ParamSpec(name="w", shape=(), dtype="f")


@pytest.mark.parametrize(
    "params",
    [
        (LONGEST_ENTRY,) * 40,
        (SHORTEST_ENTRY,) * (2 * MAX_PAGE_PARAMS),
        tuple(ParamSpec(f"layers.{i}.mlp.weight", (4096, 4096), "bfloat16") for i in range(5000)),
    ],
    ids=["longest entries", "shortest entries", "a large model"],
)
def test_every_page_model_page_builds_fits_and_the_pages_cover_the_list(
    params: tuple[ParamSpec, ...],
):
    seen: list[ParamSpec] = []
    while len(seen) < len(params):
        page = model_page(params, len(seen))
        assert page.params, "a page with entries left holds at least one"
        assert page.entries == len(params)
        assert frame_size(page) <= MAX_FRAME_BYTES
        assert decode(encode(page, session="s" * MAX_SESSION_CHARS)) == page
        seen.extend(page.params)
    assert tuple(seen) == params
    assert model_page(params, len(params)).params == ()


def test_a_page_holds_as_many_entries_as_fit_not_one_at_a_time():
    params = tuple(ParamSpec(f"layers.{i}.weight", (512, 512), "float32") for i in range(5000))
    page = model_page(params, 0)
    assert len(page.params) > 500
    assert frame_size(page) > PAGE_BYTES // 2


def test_an_entry_longer_than_a_name_may_be_is_cut_and_marked():
    cut = entry("x" * (MAX_NAME_CHARS + 10), [2, 3], "float32")
    assert len(cut.name) == MAX_NAME_CHARS
    assert cut.name.endswith("...[truncated]")
    assert cut.shape == (2, 3)
    assert entry("w", (4,), "float32") == ParamSpec("w", (4,), "float32")


def test_a_page_starting_past_the_list_is_a_value_error():
    with pytest.raises(ValueError, match="entry 4 is outside the model's 3 entries"):
        model_page((SHORTEST_ENTRY,) * 3, 4)
