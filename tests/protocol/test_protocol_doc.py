"""docs/protocol.md describes the message classes as they are: same names, same fields, in order.

Each row of the two message tables names a message type and lists its fields, each as a
backticked name followed by its type or range; the rows must be exactly the messages each side
sends, every field must be listed in the class's order, and what the row says of a field must
agree with its declared type (nil where None is allowed, every value of a closed set, the bound
of a constrained int, "optional" exactly where the field has a default). So a new field or
message fails here until the page says it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from epochal.protocol.messages import (
    MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    CoordinatorMessage,
    FieldSpec,
    Fingerprint,
    Finite,
    Ge,
    Length,
    OneOf,
    ParamSpec,
    Record,
    Within,
    WorkerMessage,
    fields_of,
    names_sent_by,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TEXT = DOC.read_text(encoding="utf-8")


def table(heading: str) -> dict[str, list[tuple[str, str]]]:
    """The rows of the table under ``## heading``: message name to its (field, description)s."""
    section = TEXT.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[tuple[str, str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) == 3 else None
        if match:
            assert match[1] not in rows, f"{heading}: {match[1]} is described twice"
            rows[match[1]] = fields_in(cells[1])
    return rows


def fields_in(cell: str) -> list[tuple[str, str]]:
    """``"`a` int ≥ 0, `b` str (said more here, `c`)"`` -> ``[("a", "int ≥ 0"), ("b", "str")]``."""
    depth, flat = 0, []
    for char in cell:  # asides in parentheses are prose, not fields
        depth += char == "("
        if depth == 0:
            flat.append(char)
        depth -= char == ")" and depth > 0
    if "".join(flat).strip() == "—":
        return []
    out = []
    for item in "".join(flat).split(","):
        match = re.fullmatch(r"\s*`(\w+)`(.*)", item)
        assert match, f"{cell!r}: {item!r} does not start with a backticked field name"
        out.append((match[1], match[2].strip()))
    return out


SIDES = {
    "Worker to coordinator": WorkerMessage,
    "Coordinator to worker": CoordinatorMessage,
}


@pytest.mark.parametrize("heading", list(SIDES))
def test_each_table_lists_exactly_the_messages_that_side_sends(heading: str):
    assert sorted(table(heading)) == sorted(names_sent_by(SIDES[heading]))


ROWS = [(h, name, fields) for h in SIDES for name, fields in table(h).items()]
IDS = [f"{h.split()[0].lower()}-{name}" for h, name, _ in ROWS]


@pytest.mark.parametrize(("heading", "name", "fields"), ROWS, ids=IDS)
def test_each_row_lists_the_fields_of_its_class_in_order(
    heading: str, name: str, fields: list[tuple[str, str]]
):
    declared = [spec.name for spec in fields_of(MESSAGE_TYPES[name])]
    assert [field for field, _ in fields] == declared, f"{heading}: {name}"


def what_it_must_say(spec: FieldSpec) -> list[str]:
    """Words a field's description must contain, from its declared type and default."""
    words = ["nil"] if spec.nilable else []
    if not spec.required:
        words.append("optional")
    choices = [c.choices for c in spec.constraints if isinstance(c, OneOf)]
    if choices:
        return words + [member.value for member in choices[0]]
    if spec.kind is int:
        for constraint in spec.constraints:
            if isinstance(constraint, Ge):
                words.append(f"≥ {constraint.least}")
            elif isinstance(constraint, Within):
                words.append(f"{constraint.lowest}..{constraint.highest}")
        return words if len(words) > spec.nilable + (not spec.required) else [*words, "int"]
    if spec.kind is tuple:
        return [*words, "list"]
    if issubclass(spec.kind, Record):
        return [*words, "map"]
    for constraint in spec.constraints:
        if isinstance(constraint, Finite):
            words.append("finite")
        elif isinstance(constraint, Length):
            words.append(f"{constraint.least}..{constraint.most}")
    return [*words, spec.kind.__name__]


@pytest.mark.parametrize(("heading", "name", "fields"), ROWS, ids=IDS)
def test_each_field_is_described_as_its_type_declares_it(
    heading: str, name: str, fields: list[tuple[str, str]]
):
    specs = {spec.name: spec for spec in fields_of(MESSAGE_TYPES[name])}
    for field, said in fields:
        spec = specs.get(field)
        assert spec is not None, f"{heading}: {name} has no field {field!r}"
        if spec.kind is int and not spec.constraints and ".." in said:
            continue  # a range between fields: "1..world_size"
        missing = [word for word in what_it_must_say(spec) if word not in said]
        assert not missing, f"{heading}: {name}.{field} is described as {said!r}, without {missing}"
        assert spec.required != ("optional" in said), f"{name}.{field} has no default"


def test_the_fingerprint_and_entry_maps_name_their_keys_in_order():
    described = TEXT.split("`fingerprint` is `", 1)[1].split("`", 1)[0]
    assert re.findall(r'"(\w+)":', described) == [spec.name for spec in fields_of(Fingerprint)]
    described = TEXT.split("an entry map is `", 1)[1].split("`", 1)[0]
    assert re.findall(r'"(\w+)":', described) == [spec.name for spec in fields_of(ParamSpec)]


def test_the_page_states_the_frame_limit():
    assert f"A frame is at most {MAX_FRAME_BYTES // 1024} KiB (`MAX_FRAME_BYTES`" in TEXT


def test_the_page_states_the_current_version():
    version = f"{PROTOCOL_VERSION}.{PROTOCOL_MINOR}"
    assert TEXT.startswith(f"# The epochal control protocol, version {version}\n")
    assert f'{{"v": {PROTOCOL_VERSION}, "t": "<type>", ["m": <minor>,]' in TEXT
    assert f"this page describes version {version}" in TEXT
