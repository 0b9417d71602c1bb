"""Single-field rules carried by the types of the settings, and the one check that enforces them.

Settings are typed ``__init__`` arguments: a ``Literal`` names the choices, and the restricted
number types below (jsonargparse's, which LightningCLI validates and shows in ``--help``) carry
their bounds. ``check_fields`` applies the same rules when a class is built in Python, so a bad
value fails at construction, before any model loads, with the field, the value and the rule::

    model.clip_range=1.5: must be > 0 and < 1

``__init__`` itself raises only for combinations of fields.
"""

from __future__ import annotations

import operator
import types
import typing
from typing import Literal, Union

from jsonargparse.typing import (
    ClosedUnitInterval,
    NonNegativeFloat,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
    restricted_number_type,
)

from lit_marl import ConfigError

UnitIntervalLeftOpen = restricted_number_type("UnitIntervalLeftOpen", float, [(">", 0), ("<=", 1)])
"""A float in (0, 1], e.g. nucleus sampling's top_p."""
UnitIntervalRightOpen = restricted_number_type("UnitIntervalRightOpen", float, [(">=", 0), ("<", 1)])
"""A float in [0, 1), e.g. a weight that must stay below a unit reward."""

__all__ = [
    "ClosedUnitInterval",
    "NonNegativeFloat",
    "NonNegativeInt",
    "OpenUnitInterval",
    "PositiveFloat",
    "PositiveInt",
    "UnitIntervalLeftOpen",
    "UnitIntervalRightOpen",
    "check_fields",
]

_SYMBOLS = {operator.gt: ">", operator.ge: ">=", operator.lt: "<", operator.le: "<="}


def check_fields(prefix: str, function, arguments: dict) -> None:
    """Raise ``ConfigError`` for the first argument of ``function`` (by its annotations) whose value
    breaks its type's rule; ``prefix`` is the config section (``model``, ``data``)."""
    hints = typing.get_type_hints(function)
    for name, value in arguments.items():
        if name in hints:
            problem = _violation(hints[name], value)
            if problem is not None:
                raise ConfigError(f"{prefix}.{name}={value!r}: {problem}")


def _violation(hint, value) -> str | None:
    """What is wrong with ``value`` for ``hint``, or None (also for types it does not judge)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        return None if value in choices else f"choose {', '.join(map(str, choices))}"
    if origin in (Union, types.UnionType):
        return _union_violation(typing.get_args(hint), value)
    restrictions = getattr(hint, "_restrictions", None)
    if restrictions is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if all(op(value, ref) for op, ref in restrictions):
        return None
    return "must be " + " and ".join(f"{_SYMBOLS[op]} {ref}" for op, ref in restrictions)


def _union_violation(members: tuple, value) -> str | None:
    optional = type(None) in members
    if value is None and optional:
        return None
    members = tuple(m for m in members if m is not type(None))
    problems = [_violation(m, value) for m in members]
    if any(p is None and _accepts(m, value) for m, p in zip(members, problems)):
        return None
    literals = [c for m in members if typing.get_origin(m) is Literal for c in typing.get_args(m)]
    others = [m for m in members if typing.get_origin(m) is not Literal]
    if not literals:
        problem = next((p for p in problems if p is not None), None)
        return None if problem is None else problem + (" (or null)" if optional else "")
    alternatives = [_a(_name(m)) for m in others] + (["null"] if optional else [])
    return f"choose {', '.join(map(str, literals))}" + (
        f" (or give {' or '.join(alternatives)})" if alternatives else ""
    )


def _accepts(member, value) -> bool:
    """Whether ``value`` can be of ``member`` (a class, a generic such as ``list[Role]``); types not
    judged here accept."""
    kind = typing.get_origin(member) or member
    if typing.get_origin(member) is Literal:
        return value in typing.get_args(member)
    if isinstance(kind, type) and kind.__module__ == "builtins":
        return isinstance(value, kind)
    return True


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _name(member) -> str:
    kind = typing.get_origin(member) or member
    return getattr(kind, "__name__", str(kind))
