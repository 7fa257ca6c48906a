"""Value types for the command line's options: each turns text into a value or says why not."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from epochal.errors import ConfigError


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)
"""An integer >= 1."""

nonnegative_int = _int_at_least(0)
"""An integer >= 0."""


def seconds_or_never(text: str) -> float | None:
    """A positive, finite number of seconds, or 0 for never (None)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value == 0:
        return None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds or 0, got {text}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


DEFAULT_HOST = "127.0.0.1"
"""Where ``--metrics-address PORT`` (no host) serves: loopback."""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (loopback) -> (host, port); ConfigError else."""
    host, colon, port = text.rpartition(":")
    if not colon:
        host, port = DEFAULT_HOST, text
    host = host.removeprefix("[").removesuffix("]") or DEFAULT_HOST
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            f"--metrics-address needs HOST:PORT or PORT (got {text!r}): e.g. 127.0.0.1:9400, "
            "or 0.0.0.0:9400 for a scraper on another machine"
        )
    return host, int(port)


def address_arg(text: str) -> str:
    """An address option's value (``--metrics-address``), checked: HOST:PORT or PORT."""
    try:
        parse_address(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
