"""A hook of the guide's build (mkdocs.yml): pipes in table cells' code, as GitHub shows them.

A pipe inside a table cell is written ``\\|``, even inside backticks, so that GitHub does not
split the cell there (the options table in cli.md, whose rows ``Option.row`` renders, has
``--batch-policy error\\|truncate``). Python-Markdown keeps the backslash inside code, so it is
removed from the code in the built page's table cells here, and nowhere else.
"""

from __future__ import annotations

import re
from typing import Any

CELL = re.compile(r"<td>(.*?)</td>", re.S)
CODE = re.compile(r"<code>(.*?)</code>", re.S)


def _unescaped(code: re.Match[str]) -> str:
    return "<code>" + code.group(1).replace("\\|", "|") + "</code>"


def on_page_content(html: str, **_: Any) -> str:
    """The page's HTML with ``\\|`` shown as ``|`` inside the code of its table cells."""
    return CELL.sub(lambda cell: "<td>" + CODE.sub(_unescaped, cell.group(1)) + "</td>", html)
