"""Environments behind one protocol (``base.py``); stateful ones register by name and are built
here, after the built-in ones have registered."""

from lit_marl import ConfigError
from lit_marl.envs import (
    alfworld,  # noqa: F401  (registers "alfworld")
    corridor,  # noqa: F401  (registers "corridor")
    swe,  # noqa: F401  (registers "swe")
    textworld,  # noqa: F401  (registers "textworld")
)
from lit_marl.envs.base import REGISTRY, Env

__all__ = ["make_env"]


def make_env(name: str, kwargs: dict | None = None, field_name: str = "data.env") -> Env:
    if name not in REGISTRY:
        raise ConfigError(f"{field_name}={name!r}: not a registered environment; choose one of {sorted(REGISTRY)}")
    try:
        return REGISTRY[name](**(kwargs or {}))
    except TypeError as err:
        raise ConfigError(f"{field_name}_kwargs={kwargs!r} do not fit environment {name!r}: {err}") from err
