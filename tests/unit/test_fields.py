"""The single-field rules that the types carry, applied by ``check_fields``."""

from __future__ import annotations

from typing import Literal

import pytest

from lit_marl import ConfigError
from lit_marl.fields import ClosedUnitInterval, OpenUnitInterval, PositiveInt, UnitIntervalLeftOpen, check_fields


def settings(
    count: PositiveInt = 1,
    cap: PositiveInt | None = None,
    mode: Literal["a", "b"] = "a",
    share: OpenUnitInterval = 0.5,
    gamma: ClosedUnitInterval = 1.0,
    top_p: UnitIntervalLeftOpen = 1.0,
    tests: int | Literal["all"] | None = 1,
    plain: int = 0,
):
    """A settings signature like the modules'."""


@pytest.mark.parametrize(
    "values, message",
    [
        ({"count": 0}, "x.count=0: must be > 0"),
        ({"cap": 0}, "x.cap=0: must be > 0 (or null)"),
        ({"mode": "c"}, "x.mode='c': choose a, b"),
        ({"share": 1.0}, "x.share=1.0: must be > 0 and < 1"),
        ({"gamma": 1.5}, "x.gamma=1.5: must be >= 0 and <= 1"),
        ({"top_p": 0.0}, "x.top_p=0.0: must be > 0 and <= 1"),
        ({"tests": "some"}, "x.tests='some': choose all (or give an int or null)"),
    ],
)
def test_a_broken_rule_names_the_field_the_value_and_the_rule(values, message):
    with pytest.raises(ConfigError) as err:
        check_fields("x", settings, values)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "values",
    [
        {"count": 3, "cap": None, "mode": "b", "share": 0.2, "gamma": 0.0, "top_p": 1.0},
        {"cap": 7, "gamma": 1, "tests": "all"},
        {"tests": None, "plain": -5, "unannotated": object()},
    ],
)
def test_values_within_the_rules_pass(values):
    check_fields("x", settings, values)
