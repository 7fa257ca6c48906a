"""The user guide (docs/, mkdocs.yml) builds without a warning, and the README's links hold.

``mkdocs build --strict`` with mkdocs.yml's ``validation`` settings turns every broken internal
link, missing anchor and page left out of the navigation into a warning, and a warning into a
failed build; the build needs no network (the theme's web fonts are off, and nothing else is
fetched). The README is not part of the site, so its links are checked here: every relative link
names a file that exists, and an anchor names a heading of the target, slugified as mkdocs does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

from tests.projectfiles import project_files

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"

FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\]]|\n)*?\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")


def prose(text: str) -> Iterator[str]:
    """The lines of a Markdown text outside its fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def anchors(page: Path) -> set[str]:
    """The ids mkdocs gives the headings of ``page``: the toc extension's slugify, lowercased,
    with "-" between words, and "_1", "_2" after a repeated one."""
    seen: set[str] = set()
    for line in prose(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link: its text
        text = text.replace("`", "").replace("**", "").replace("*", "")
        slug = base = slugify(text, "-")
        count = 0
        while slug in seen:
            count += 1
            slug = f"{base}_{count}"
        seen.add(slug)
    return seen


def links(page: Path) -> list[str]:
    """The targets of the inline links and images of ``page``, outside code."""
    text = "\n".join(prose(page.read_text(encoding="utf-8")))
    return LINK.findall(INLINE_CODE.sub("", text))


def nav_pages(nav: object) -> Iterator[str]:
    """Every page named in mkdocs.yml's ``nav``, at any depth."""
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from nav_pages(value)


def test_the_guide_builds_without_a_warning(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # the theme's notice about its future
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"mkdocs build --strict failed (exit {done.returncode}):\n{output}"
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert not warnings, "mkdocs build warned:\n" + output
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_relative_link_of_the_readme_names_a_file_and_a_heading_there() -> None:
    broken = []
    targets = links(README)
    assert any(t.startswith("docs/") for t in targets), "the README links to no page of the guide"
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = README if not path else (README.parent / path)
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and anchor not in anchors(file):
            broken.append(f"{target}: no heading of {file.relative_to(REPO)} has the id {anchor!r}")
    assert not broken, "the README's broken links:\n" + "\n".join(broken)


def test_every_page_of_the_guide_is_in_the_navigation() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["docs_dir"] == "docs"
    listed = set(nav_pages(config["nav"]))
    pages = {
        page.relative_to(DOCS).as_posix()
        for page in project_files(REPO)
        if page.suffix == ".md" and DOCS in page.parents
    }
    missing = sorted(pages - listed)
    assert not missing, f"pages of docs/ that mkdocs.yml's nav does not list: {missing}"
    absent = sorted(listed - pages)
    assert not absent, f"pages mkdocs.yml's nav lists that docs/ does not hold: {absent}"


def test_slugs_are_the_ones_mkdocs_gives(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n```\n# not a heading\n```\n\n## The coordinator's address in a file\n\n"
        "## A custom loop: `epochal.join` and `run_epochs`\n\n## Title\n",
        encoding="utf-8",
    )
    assert anchors(page) == {
        "title",
        "the-coordinators-address-in-a-file",
        "a-custom-loop-epochaljoin-and-run_epochs",
        "title_1",
    }


def _torch_range() -> str:
    """The torch requirement in pyproject.toml, without its name: ``>=2.13,<2.15``."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    return spec.removeprefix("torch").strip()


def test_the_readme_and_the_install_page_give_pyprojects_torch_range() -> None:
    from packaging.specifiers import SpecifierSet

    wanted = _torch_range()
    # the releases named in words: "torch 2.13 and 2.14" for >=2.13,<2.15
    supported = [
        f"2.{minor}" for minor in range(100) if SpecifierSet(wanted).contains(f"2.{minor}.0")
    ]
    assert supported, f"pyproject's torch range {wanted!r} admits no 2.x release"
    for page in (README, DOCS / "install.md"):
        text = " ".join(page.read_text().split())
        assert f"torch{wanted}" in text, f"{page.name} does not say torch{wanted} (pyproject.toml)"
        said = f"torch {' and '.join(supported)}" if len(supported) <= 2 else None
        assert said is None or said in text, f"{page.name} does not say {said!r}"
        for pin in re.findall(r"torch==([\d.]+)", text):
            assert SpecifierSet(wanted).contains(pin), f"{page.name} pins torch=={pin}, outside"
