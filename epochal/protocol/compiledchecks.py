"""A record's field checks as one function of its own, compiled from the constraints declared.

:class:`~epochal.protocol.registry.Record` checks every constrained field whenever a record is
made: by its sender, and by msgspec for every record it decodes (each loss report holds four).
Walking the declared constraints and calling each one cost most of decoding a frame; the
function :func:`compile_checks` writes holds each common constraint's test inline
(:class:`~epochal.protocol.constraints.Ge`, ``Within``, ``Finite``, ``Chars``, ``Length``,
``Items``, a ``OneOf`` string), and calls the constraint itself only when its test fails, so
the error raised is the constraint's own, word for word. Any other constraint is called as it
is declared. The order of the checks and what a check turns a value into (an enum member for a
string) are the declared ones.

This module's imports are private (underscored).
"""

import math as _math
from collections.abc import Callable as _Callable
from typing import Any as _Any

from epochal.protocol import constraints as _constraints

Checks = tuple[tuple[str, bool, tuple[_constraints.Constraint, ...]], ...]
"""A record's constrained fields: name, whether None is allowed, the constraints in order."""


def _test(constraint: _Any, value: str) -> str | None:
    """The inline test that ``value`` (a variable's name) passes ``constraint``; None where the
    constraint is to be called whatever the value (it may turn the value into another)."""
    kind = type(constraint)
    if kind is _constraints.Ge:
        return f"{value} >= {constraint.least!r}"
    if kind is _constraints.Within:
        return f"{constraint.lowest!r} <= {value} <= {constraint.highest!r}"
    if kind is _constraints.Finite:
        return f"_isfinite({value})"
    if kind is _constraints.Chars:
        test = f"len({value}) <= {constraint.most!r}"
        return test if constraint.empty else f"{test} and {value} != ''"
    if kind is _constraints.Length:
        return f"{constraint.least!r} <= len({value}) <= {constraint.most!r}"
    if kind is _constraints.Items:
        return f"len({value}) <= {constraint.most!r}"
    return None


def compile_checks(owner: str, checks: Checks) -> _Callable[[_Any], None]:
    """The function that checks a record of class ``owner`` (its name) as ``checks`` declare:
    a failing field raises its constraint's ValueError; a field a constraint turns into another
    value (a string into its enum member) is set to it."""
    scope: dict[str, _Any] = {"_isfinite": _math.isfinite, "_set": object.__setattr__}
    lines = ["def check(self):"]
    for i, (name, nilable, constraints) in enumerate(checks):
        value, indent = f"v{i}", "    "
        lines.append(f"{indent}{value} = self.{name}")
        if nilable:
            lines.append(f"{indent}if {value} is not None:")
            indent += "    "
        changed = False
        for j, constraint in enumerate(constraints):
            called = f"c{i}_{j}"
            scope[called] = constraint
            test = _test(constraint, value)
            if test is not None:
                lines.append(f"{indent}if not ({test}):")
                lines.append(f"{indent}    {called}({name!r}, {value})")
            elif type(constraint) is _constraints.OneOf:
                members = f"m{i}_{j}"
                scope[members] = constraint.choices._value2member_map_
                member = f"{value}m"
                lines.append(
                    f"{indent}{member} = {members}.get({value}) if type({value}) is str else None"
                )
                lines.append(f"{indent}if {member} is None:")
                lines.append(f"{indent}    {member} = {called}({name!r}, {value})")
                lines.append(f"{indent}{value} = {member}")
                changed = True
            else:
                lines.append(f"{indent}{value} = {called}({name!r}, {value})")
                changed = True
        if changed:
            lines.append(f"{indent}if {value} is not self.{name}:")
            lines.append(f"{indent}    _set(self, {name!r}, {value})")
    lines.append("    self._validate()")
    code = compile("\n".join(lines), f"<checks of {owner}>", "exec")
    exec(code, scope)  # made above from the declared constraints alone
    check: _Callable[[_Any], None] = scope["check"]
    return check
