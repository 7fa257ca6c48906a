"""Every legitimate message fits in a frame, so the frame limit can be small.

The coordinator's socket refuses frames over MAX_FRAME_BYTES (ZMQ_MAXMSGSIZE), so that a stranger
cannot make it hold or decode anything large. That is only right if no legitimate message is ever
larger: here the largest of each type, every string at its longest in four-byte characters, every
number at its widest, every list at its longest, is encoded with the longest session a worker
presents, and must fit. A model's parameter list travels in pages that model_page builds, each of
which must fit too, whatever the entries.
"""

from __future__ import annotations

from typing import Any

import pytest

from epochal.protocol import decode, encode
from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_NAME_CHARS,
    MAX_PAGE_PARAMS,
    MAX_SESSION_CHARS,
    MAX_SHAPE_DIMS,
    MESSAGE_TYPES,
    TYPE_NAMES,
    Hello,
    ModelPage,
    ParamSpec,
    WorkerMessage,
)
from epochal.protocol.paging import PAGE_BYTES, entry, model_page
from tests.protocol.examples import UINT64, WIDE, largest_examples


def frame_size(message: Any) -> int:
    worker = isinstance(message, WorkerMessage) and not isinstance(message, Hello)
    return len(encode(message, session="s" * MAX_SESSION_CHARS if worker else ""))


@pytest.mark.parametrize(
    "cls", [c for c in MESSAGE_TYPES.values() if c is not ModelPage], ids=TYPE_NAMES.get
)
def test_the_largest_message_of_each_type_fits_in_a_frame(cls: type):
    # every value at its largest, as the fields declare it: each string at its bound in
    # four-byte characters, each int the widest msgpack packs, each list at its declared Items
    # bound (tests/protocol/examples.py), in every member of each closed set
    for message in largest_examples(cls):
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
