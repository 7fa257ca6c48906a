"""The command-line page (docs/cli.md) is checked against the parser that ``epochal`` runs.

Its command list names every command of ``build_parser()`` and no other; every option of every
command is a row of a table under a heading that names the command, and every row names an option
that command has; its exit statuses are the ones the code returns and the ones ``epochal --help``
lists. The shared options' rows themselves are compared with their declarations in
tests/test_settings.py.
"""

from __future__ import annotations

import argparse
import re
import signal
from collections.abc import Iterator
from pathlib import Path

from epochal.cli.parser import EXIT_USAGE, build_parser
from epochal.errors import CoordinatorUnreachable
from epochal.launch.attempt import EXIT_FAILED, EXIT_OK
from epochal.launch.daemon import EXIT_CRASH
from epochal.launch.processes import ORPHAN_EXIT_CODE
from epochal.worker.control.backstop import ABORT_EXIT_CODE
from epochal.zygote.child import ORPHAN_EXIT_CODE as ZYGOTE_ORPHAN_EXIT_CODE

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEADING = re.compile(r"^(#{2,3}) (.*)$")
COMMAND = re.compile(r"`(epochal(?: [a-z]+)*)`")
FLAG = re.compile(r"`(--?[a-z][a-z-]*)")


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every parser of a command under it, at any depth."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from commands(sub)


def is_group(parser: argparse.ArgumentParser) -> bool:
    """Whether ``parser`` only chooses a command under it (``epochal keys``)."""
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def sections(text: str) -> dict[str, list[str]]:
    """The lines under each ``##`` / ``###`` heading of ``text``, by heading, outside code."""
    found: dict[str, list[str]] = {}
    lines: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else HEADING.match(line)
        if heading:
            lines = found.setdefault(heading.group(2), [])
        else:
            lines.append(line)
    return found


def table_rows(lines: list[str]) -> list[list[str]]:
    """The cells of each body row of the tables in ``lines``."""
    rows = [line.strip().strip("|").split(" | ") for line in lines if line.startswith("| ")]
    return [r for r in rows if r[0].strip() not in ("option", "status", "---")]


def page() -> dict[str, list[str]]:
    return sections(PAGE.read_text(encoding="utf-8"))


def test_the_command_list_names_every_command_and_no_other():
    parsers = [p for p in commands(build_parser()) if p.prog != "epochal" and not is_group(p)]
    lines = page()["Commands"]
    start = lines.index("```")
    listed = lines[start + 1 : lines.index("```", start + 1)]
    named = set()
    for line in listed:
        words = line.split()
        assert words[0] == "epochal", line
        # "epochal keys generate DIR": the command's words up to its first argument
        name = ["epochal"]
        while len(words) > len(name) and re.fullmatch(r"[a-z]+", words[len(name)]):
            name.append(words[len(name)])
        named.add(" ".join(name))
    assert named == {p.prog for p in parsers}, (
        f"docs/cli.md's command list names {sorted(named)}; the parser has "
        f"{sorted(p.prog for p in parsers)}"
    )


def test_every_option_of_every_command_is_a_row_under_its_heading():
    documented: dict[str, set[str]] = {}
    for heading, lines in page().items():
        for command in COMMAND.findall(heading) if heading.startswith("Options of") else []:
            for row in table_rows(lines):
                documented.setdefault(command, set()).update(FLAG.findall(row[0]))
    missing = [
        f"{p.prog}: {flag}"
        for p in commands(build_parser())
        for flag in sorted(options(p) - documented.get(p.prog, set()))
    ]
    assert not missing, (
        "options missing from docs/cli.md (a row under an 'Options of `COMMAND`' heading):\n"
        + "\n".join(missing)
    )


def test_every_row_names_an_option_of_a_command_its_heading_names():
    parsers = {p.prog: p for p in commands(build_parser())}
    unknown = []
    for heading, lines in page().items():
        if not heading.startswith("Options of"):
            continue
        named = COMMAND.findall(heading)
        assert named and set(named) <= set(parsers), f"{heading!r} names no command of the parser"
        offered = set().union(*(options(parsers[c]) for c in named))
        rows = table_rows(lines)
        assert rows, f"{heading!r} has no table"
        unknown += [f"{heading}: {f}" for row in rows for f in set(FLAG.findall(row[0])) - offered]
    assert not unknown, "docs/cli.md rows naming options those commands lack:\n" + "\n".join(
        unknown
    )


def statuses(lines: list[str]) -> list[list[int]]:
    """The status codes of each table in ``lines``, a list per table."""
    tables: list[list[int]] = []
    within = False
    for line in lines:
        if line.startswith("| status |"):
            tables.append([])
            within = True
        elif not line.startswith("|"):
            within = False
        elif within and line.split("|")[1].strip().isdigit():
            tables[-1].append(int(line.split("|")[1]))
    return tables


def test_the_exit_statuses_are_the_ones_the_commands_return_and_help_lists():
    commands_, workers = statuses(page()["Exit status"])
    returned = {
        EXIT_OK,
        EXIT_FAILED,
        EXIT_USAGE,
        EXIT_CRASH,
        128 + signal.SIGINT,
        128 + signal.SIGTERM,
    }
    assert set(commands_) == returned, f"docs/cli.md lists {commands_}; the code has {returned}"
    epilog = build_parser().epilog or ""
    helped = {int(n) for n in re.findall(r"\b(\d+) ", epilog.split("Exit status:", 1)[1])}
    assert helped == set(commands_), f"epochal --help says {helped}; docs/cli.md {commands_}"
    assert ORPHAN_EXIT_CODE == ZYGOTE_ORPHAN_EXIT_CODE
    own = {CoordinatorUnreachable.exit_code, ORPHAN_EXIT_CODE, ABORT_EXIT_CODE}
    assert set(workers) == own, f"docs/cli.md lists {workers} for a worker; the code has {own}"


def test_the_sections_and_rows_are_read_as_the_page_means_them():
    text = (
        "## Exit status\n\n| status | meaning |\n| --- | --- |\n| 0 | ok |\n| 75 | late |\n\n"
        "```\n## not a heading\n```\n\n### Options of `epochal run` and `epochal plot`\n\n"
        "| option | default | meaning |\n| --- | --- | --- |\n"
        "| `-o FILE`, `--output FILE` | | x |\n"
    )
    found = sections(text)
    assert list(found) == ["Exit status", "Options of `epochal run` and `epochal plot`"]
    assert statuses(found["Exit status"]) == [[0, 75]]
    (row,) = table_rows(found["Options of `epochal run` and `epochal plot`"])
    assert FLAG.findall(row[0]) == ["-o", "--output"]
    assert COMMAND.findall("Options of `epochal run` and `epochal plot`") == [
        "epochal run",
        "epochal plot",
    ]
