"""Suggestions ("did you mean ...?"): the names a misspelt or shortened one most likely stands for.

One rule for every place a person types a name epochal knows: an option on the command line
(``--epoch`` for ``--epochs``), a key of a settings file, a metric for ``--monitor`` (``acc`` for
``accuracy``). Close spellings come from :mod:`difflib`; a name that begins another (a
shortening) counts too, which difflib alone misses when the rest is long. Standard library only.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

MAX_SUGGESTIONS = 3
"""The most names one suggestion offers."""

CUTOFF = 0.6
"""How alike (difflib's ratio, 0 to 1) a spelling must be to be offered: ``jbo`` is 0.67 like
``job``, ``epohcs`` 0.83 like ``epochs``. The likeliest comes first, so where one suggestion is
shown (an option, a metric) it is the closest."""


def _bare(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def close_matches(word: str, valid: Iterable[str], n: int = MAX_SUGGESTIONS) -> list[str]:
    """The names of ``valid`` that ``word`` most likely stands for, the likeliest first: close
    spellings (dashes and underscores alike, leading dashes aside), then the names it begins."""
    names = list(dict.fromkeys(valid))
    by_bare = {_bare(name): name for name in reversed(names)}
    bare = _bare(word)
    close = difflib.get_close_matches(bare, list(by_bare), n=n, cutoff=CUTOFF)
    shortened = sorted((b for b in by_bare if len(bare) >= 2 and b.startswith(bare)), key=len)
    found = [by_bare[b] for b in dict.fromkeys([*close, *shortened]) if b != bare]
    return found[:n]


def did_you_mean(word: str, valid: Iterable[str], quote: bool = False) -> str:
    """``"; did you mean --epochs?"`` for ``word`` among ``valid`` (``quote``: names in quotes,
    ``'epochs'``); ``""`` when nothing is close."""
    found = close_matches(word, valid)
    if not found:
        return ""
    shown = [repr(name) if quote else name for name in found]
    return f"; did you mean {' or '.join(shown)}?"
