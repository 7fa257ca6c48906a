"""The user guide reads in short paragraphs: none over 120 words, and no nested parentheses.

The pages checked are those of mkdocs.yml's nav outside its "For contributors" section, and the
README. A paragraph is a run of prose lines between blank lines; each item of a list is a
paragraph of its own, with the lines that continue it. Fenced code blocks, tables, headings, HTML
and admonition markers are not paragraphs. A word is anything between spaces, a link counted by
its text only. Parentheses inside a code span or a link's target do not count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.test_docs import FENCE, README, REPO, nav_pages

BOUND = 120
"""The most words a paragraph of the guide may have."""

CONTRIBUTORS = "For contributors"
"""The nav section whose pages, written for people who work on Epochal itself, are exempt."""

ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
ADMONITION = re.compile(r"^\s*(?:!!!|\?\?\?\+?)\s")
CODE_SPAN = re.compile(r"(`+)(?:.|\n)*?\1")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
AUTOLINK = re.compile(r"<[a-z][a-z0-9+.-]*:[^>\s]*>")


@dataclass(frozen=True)
class Paragraph:
    page: str
    line: int
    text: str

    @property
    def words(self) -> int:
        return len(LINK_TARGET.sub("]", self.text).split())

    def nested(self) -> tuple[int, str] | None:
        """The line of an opening parenthesis inside another one, and the text around it."""
        plain = self.text
        for pattern in (CODE_SPAN, LINK_TARGET, AUTOLINK):  # blanked, each character in place
            plain = pattern.sub(lambda m: re.sub(r"[^\n]", "_", m.group(0)), plain)
        depth = 0
        for at, char in enumerate(plain):
            if char == "(":
                depth += 1
                if depth == 2:
                    start = max(0, plain.rfind("(", 0, at) - 20)
                    return self.line + self.text.count("\n", 0, at), self.text[start : at + 40]
            elif char == ")":
                depth = max(0, depth - 1)
        return None


def paragraphs(page: str, text: str) -> Iterator[Paragraph]:
    """The paragraphs of a Markdown ``text``, each with the number of its first line."""
    lines: list[str] = []
    first = 0
    fenced = comment = False

    def block() -> Iterator[Paragraph]:
        if lines:
            yield Paragraph(page, first, "\n".join(lines))
            lines.clear()

    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if FENCE.match(stripped):
            yield from block()
            fenced = not fenced
            continue
        if fenced:
            continue
        if comment or stripped.startswith("<"):
            yield from block()
            comment = ("<!--" in stripped or comment) and "-->" not in stripped
            continue
        if not stripped or stripped.startswith(("#", "|")) or ADMONITION.match(line):
            yield from block()
            continue
        if ITEM.match(line):
            yield from block()
            line = ITEM.sub("", line)
        if not lines:
            first = number
        lines.append(line.strip())
    yield from block()


def user_pages() -> list[Path]:
    """The README and the pages of the nav, less the contributors' section."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = [e for e in config["nav"] if not (isinstance(e, dict) and CONTRIBUTORS in e)]
    assert len(nav) < len(config["nav"]), f"mkdocs.yml's nav has no {CONTRIBUTORS!r} section"
    return [README, *(REPO / config["docs_dir"] / page for page in nav_pages(nav))]


def faults(page: Path) -> Iterator[str]:
    name = page.relative_to(REPO).as_posix()
    for p in paragraphs(name, page.read_text(encoding="utf-8")):
        if p.words > BOUND:
            yield f"{p.page}:{p.line}: a paragraph of {p.words} words (at most {BOUND})"
        nested = p.nested()
        if nested is not None:
            line, around = nested
            yield f"{p.page}:{line}: nested parentheses: {around!r}"


def test_no_paragraph_of_the_guide_is_long_or_nests_parentheses() -> None:
    pages = user_pages()
    assert len(pages) > 10 and all(p.is_file() for p in pages), pages
    found = [fault for page in pages for fault in faults(page)]
    assert not found, "split these paragraphs, or unnest their parentheses:\n" + "\n".join(found)


def test_the_check_counts_prose_only(tmp_path: Path) -> None:
    long = " ".join(["word"] * (BOUND + 1))
    page = tmp_path / "page.md"
    page.write_text(
        f"# {long}\n\n"  # a heading
        f"```\n{long}\n(a (b))\n```\n\n"  # a code block
        f"| {long} |\n|---|\n\n"  # a table
        f"<!-- {long}\n(a (b)) -->\n\n"  # HTML
        "!!! note\n    A short note, `f(g(x))` in code, [a link](https://x.org/y).\n\n"
        f"Line {' '.join(['word'] * 60)}\n"
        f"{' '.join(['word'] * 60)} [text](page.md#a-long-anchor)\n\n"
        "- a short item\n"
        f"- {' '.join(['word'] * 100)}\n  {' '.join(['word'] * 30)}\n\n"
        "1. one (two\n   (three))\n",
        encoding="utf-8",
    )
    found = list(paragraphs("page.md", page.read_text(encoding="utf-8")))
    assert [(p.line, p.words) for p in found] == [(15, 8), (17, 122), (20, 3), (21, 130), (24, 3)]
    assert [p.nested() for p in found if p.nested()] == [(25, "one (two\n(three))")]
