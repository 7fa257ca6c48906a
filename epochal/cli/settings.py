"""Options declared once: a dataclass field carries its help, flag, value type and resume policy.

A field of :class:`~epochal.coordinator.config.CoordinatorConfig` is declared as
``field(default=..., metadata=setting(...))``, its :class:`Setting` in the field's metadata. From
there the command line is generated (:func:`field_options`, :meth:`Option.add_to`: flag, default,
help, type), the resume check learns which settings may change between a run and its resumption
and how to name them, and the guide's options table (docs/cli.md) is checked (:meth:`Option.row`).
A default, a help text or a flag is therefore written in one place, where the field is.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

SETTING = "epochal.setting"
"""The key of a field's :class:`Setting` in its metadata."""

OnResume = Literal["refuse", "may_change", "when_known", "may_grow", "steers"]
"""What a resume does when the setting differs from the run's: refuse it (it changes the result);
let it change (a timeout, a path, the world size: a resume at another size says so); refuse it
only when both the run and the resume know it; let it grow and refuse it smaller (``epochs``:
a run, finished or not, may be trained further); or let it change from the resumed epoch on,
saying so and keeping the change in run.json (``steers``: a setting that only steers decisions
still to come, such as ``patience``, while the epochs already decided keep the value they were
decided under)."""

RUN_POLICY = "run policy"
CHECKPOINTS = "checkpoints and resume"
TIMEOUTS = "timeouts (seconds)"
FAILURES = "failures"
WATCHING = "watching the run"
GROUPS = (RUN_POLICY, CHECKPOINTS, TIMEOUTS, FAILURES, WATCHING)
"""The command line's option groups, in the order ``--help`` shows them."""


@dataclass(frozen=True, slots=True)
class Flag:
    """How a setting appears on the command line."""

    group: str
    # one of GROUPS
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    # turns the text into the value, or raises argparse.ArgumentTypeError saying why not
    choices: tuple[str, ...] | None = None
    negated: bool = False
    # a boolean whose flag is --no-NAME, which stores False
    shown: str | None = None
    # the default as help and the guide say it; None: the field's default as written


@dataclass(frozen=True, slots=True)
class Setting:
    """A configuration field's documentation and policies; see :func:`setting`."""

    help: str
    on_resume: OnResume = "refuse"
    called: str | None = None
    # how a refused resume names the setting; None: its flag
    flag: Flag | None = None
    # None: not on the command line


def setting(
    *,
    help: str,
    on_resume: OnResume = "refuse",
    called: str | None = None,
    flag: Flag | None = None,
) -> dict[str, Setting]:
    """Field metadata holding a :class:`Setting`: ``field(default=..., metadata=setting(...))``."""
    return {SETTING: Setting(help=help, on_resume=on_resume, called=called, flag=flag)}


def settings(cls: type[Any]) -> dict[str, Setting]:
    """Each field of the dataclass ``cls`` that carries a :class:`Setting`, by name."""
    return {f.name: f.metadata[SETTING] for f in dataclasses.fields(cls) if SETTING in f.metadata}


def flag_name(name: str, *, negated: bool = False) -> str:
    """The command-line flag of the field ``name``: ``--name-with-dashes`` (``--no-...``)."""
    return ("--no-" if negated else "--") + name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option: its flag, default, help and type, and its row in the guide."""

    dest: str
    help: str
    group: str
    default: Any = None
    action: Literal["store", "store_true", "store_false"] = "store"
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    shown: str | None = None
    # the default as written in help and the guide; None: the default itself

    @property
    def flag(self) -> str:
        return flag_name(self.dest, negated=self.action == "store_false")

    @property
    def shown_default(self) -> str | None:
        """The default as help and the guide say it; None for a switch."""
        if self.action != "store":
            return None
        return self.shown if self.shown is not None else _shown(self.default)

    @property
    def full_help(self) -> str:
        shown = self.shown_default
        return self.help if shown is None else f"{self.help} (default: {shown})"

    def add_to(self, parser: argparse._ActionsContainer) -> None:
        """Add the option to ``parser`` (or to one of its argument groups)."""
        help = self.full_help.replace("%", "%%")  # argparse formats help with %
        if self.action != "store":
            parser.add_argument(self.flag, dest=self.dest, action=self.action, help=help)
            return
        kwargs: dict[str, Any] = {"default": self.default, "help": help}
        if self.choices is not None:
            kwargs["choices"] = self.choices
        else:
            kwargs["metavar"] = self.metavar
        if self.type is not None:
            kwargs["type"] = self.type
        parser.add_argument(self.flag, dest=self.dest, **kwargs)

    def row(self) -> str:
        """The option's row in the options table of docs/cli.md (Markdown)."""
        if self.choices is not None:
            usage = f"{self.flag} {'|'.join(self.choices)}"
        elif self.action == "store" and self.metavar is not None:
            usage = f"{self.flag} {self.metavar}"
        else:
            usage = self.flag
        cells = (f"`{usage}`", self.shown_default or "", self.help)
        return "|" + "|".join(f" {c} " if c else " " for c in map(_escaped, cells)) + "|"


def _escaped(cell: str) -> str:
    return cell.replace("|", "\\|")


def field_options(cls: type[Any]) -> Iterator[Option]:
    """The command-line options of the dataclass ``cls``: its fields whose Setting has a Flag."""
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(SETTING)
        if spec is None or spec.flag is None:
            continue
        flag = spec.flag
        yield Option(
            dest=f.name,
            help=spec.help,
            group=flag.group,
            default=f.default,
            action="store_false" if flag.negated else _switch_or_value(f.default),
            metavar=flag.metavar,
            type=flag.type,
            choices=flag.choices,
            shown=flag.shown,
        )


def _switch_or_value(default: Any) -> Literal["store", "store_true"]:
    """A boolean that is off unless asked for is a switch (``--keep-schedule``); else a value."""
    return "store_true" if default is False else "store"


def grouped(options: Iterable[Option]) -> list[Option]:
    """``options`` in the order ``--help`` shows them: by group (:data:`GROUPS`), then as given."""
    return sorted(options, key=lambda o: GROUPS.index(o.group))


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Add ``options`` to ``parser``, each in its group, the groups in :data:`GROUPS` order."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in grouped(options):
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        option.add_to(groups[option.group])
