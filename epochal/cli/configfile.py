"""A run's settings in a TOML file: ``--config FILE``, and ``epochal.toml`` beside the script.

The file's keys are the command's options, written as the option's name with underscores
(``lr_schedule = "cosine"`` for ``--lr-schedule``; the dashed spelling is accepted too); a switch
takes ``true`` or ``false`` (``restore_best = false`` for ``--no-restore-best``). The command line
wins over the file, the file over the defaults: the file's values become the parser's defaults and
the command line is parsed again. Each value goes through the option's own type, so that a value
refused on the command line is refused in the file with the same reason, prefixed with the file
and the key. Paths are read as on the command line, from the directory epochal runs in.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from epochal.cli.argtypes import nonnegative_int, positive_int, seconds, seconds_or_never
from epochal.cli.suggest import did_you_mean
from epochal.errors import ConfigError

DEFAULT_FILE = "epochal.toml"
"""The file ``epochal run`` reads from the script's directory unless ``--no-config``."""

COMMANDS = ("run", "coordinator", "worker")
"""The commands that take ``--config``."""

NOT_SETTINGS = frozenset(
    {"help", "config", "no_config", "log_level", "log_format", "module", "script", "resume"}
)
"""Options of those commands the file cannot set: how the command line itself is read, the
logging options shared with the command before them, what names the script, and ``--resume``
(which run to continue is asked each time, not a setting of the run)."""

_INTEGER_TYPES: tuple[Callable[[str], Any], ...] = (int, positive_int, nonnegative_int)
_NUMBER_TYPES: tuple[Callable[[str], Any], ...] = (float, seconds, seconds_or_never)


def add_config_options(parser: argparse.ArgumentParser, *, beside_script: bool) -> None:
    """``--config FILE`` (and, for a command with a script, ``--no-config``) on ``parser``."""
    g = parser.add_argument_group("settings file")
    default = (
        f" (default: {DEFAULT_FILE} in the script's directory, if there is one)"
        if beside_script
        else ""
    )
    g.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="read settings from the TOML file FILE: a key per option, its name with "
        "underscores (max_restarts = 3 for --max-restarts 3); options given on the command "
        f"line win{default}",
    )
    if beside_script:
        g.add_argument(
            "--no-config",
            action="store_true",
            help=f"read no settings file, not even {DEFAULT_FILE} beside the script",
        )


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, Path | None]:
    """Parse ``argv`` with the settings file's values as defaults; also return the file read.

    A first parse, with no option required, finds the command, ``--config`` and the script; the
    file's values then become that command's defaults (an option the file gives is no longer
    required) and ``argv`` is parsed again. A bad file raises ConfigError naming it.
    """
    first = _parsed_leniently(parser, argv)
    sub = _subparser(parser, first.command)
    path = None if sub is None else settings_file(first)
    if sub is None or path is None:
        return parser.parse_args(argv), None
    values = read(path, sub)
    for action in sub._actions:
        if action.dest in values:
            action.required = False
    sub.set_defaults(**values)
    return parser.parse_args(argv), path


def settings_file(args: argparse.Namespace) -> Path | None:
    """The file to read: ``--config``, else ``epochal.toml`` beside ``epochal run``'s script."""
    if args.config is not None:
        if not args.config.is_file():
            raise ConfigError(f"--config: {args.config} is not a file")
        return Path(args.config)
    if args.command != "run" or args.no_config or args.module:
        return None
    beside = Path(args.script).parent / DEFAULT_FILE
    return beside if beside.is_file() else None


def read(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The settings in the TOML file ``path`` as the values ``parser``'s options would store."""
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    actions = settable(parser)
    values: dict[str, Any] = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"{path}: {_unknown(key, sorted(actions))}")
        if dest in values:
            raise ConfigError(f"{path}: {key}: given twice (as {dest} and with dashes)")
        values[dest] = _value(action, value, f"{path}: {key}")
    return values


def settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The options of ``parser`` a settings file may set, by key (the option's dest)."""
    return {
        action.dest: action
        for action in parser._actions
        if action.option_strings and action.dest not in NOT_SETTINGS
    }


def _unknown(key: str, valid: list[str]) -> str:
    suggestion = did_you_mean(key, valid, quote=True)
    if suggestion:
        return f"unknown key {key!r}{suggestion}"
    return f"unknown key {key!r}; the keys are {', '.join(valid)}"


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` from the file as ``action`` would store it, or a ConfigError saying why not."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_shown(value)}")
        return value
    if action.type in _INTEGER_TYPES:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_shown(value)}")
    elif action.type in _NUMBER_TYPES:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {_shown(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value}")
    elif not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {_shown(value)}")
    text = str(value)
    if action.type is None:
        converted: Any = text
    else:
        try:
            converted = action.type(text)  # type: ignore[operator]
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: invalid value {text!r}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ConfigError(f"{where}: invalid choice: {text!r} (choose from {choices})")
    return converted


def _shown(value: Any) -> str:
    kind = {
        bool: "a boolean",
        str: "a string",
        int: "an integer",
        float: "a number",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)
    if isinstance(value, list | dict):
        return kind
    return f"{kind} ({str(value).lower() if isinstance(value, bool) else repr(value)})"


class _Fallback(Exception):
    """The lenient parse would print something or exit: the strict one does it instead."""


def _parsed_leniently(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``argv`` parsed with no option required (the settings file may give them).

    Anything this parse would print (an error, ``--help``, ``--version``) is left to the strict
    parse, so that messages and usage lines read as without a settings file.
    """

    def fall_back(*args: object, **kwargs: object) -> NoReturn:
        raise _Fallback

    parsers = _parsers(parser)
    required = [a for p in parsers for a in p._actions if a.option_strings and a.required]
    for action in required:
        action.required = False
    for p in parsers:
        for name in ("error", "exit", "print_help", "print_usage", "_print_message"):
            setattr(p, name, fall_back)
    try:
        return parser.parse_args(argv)
    except _Fallback:
        _restore(parsers, required)
        return parser.parse_args(argv)  # prints, and exits, as without a settings file
    finally:
        _restore(parsers, required)


def _restore(parsers: list[argparse.ArgumentParser], required: list[argparse.Action]) -> None:
    for action in required:
        action.required = True
    for p in parsers:
        for name in ("error", "exit", "print_help", "print_usage", "_print_message"):
            p.__dict__.pop(name, None)


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and its subcommands' parsers, theirs in turn included."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *(q for s in subs for p in s.choices.values() for q in _parsers(p))]


def _subparser(
    parser: argparse.ArgumentParser, command: str | None
) -> argparse.ArgumentParser | None:
    if command not in COMMANDS:
        return None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found = action.choices.get(command)
            return found if isinstance(found, argparse.ArgumentParser) else None
    return None
