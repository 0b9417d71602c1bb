"""Environments behind one protocol (``base.py``); stateful ones register by name and are built
here, after the built-in ones have registered."""

from lit_marl import ConfigError
from lit_marl.envs import (
    alfworld,  # noqa: F401  (registers "alfworld")
    corridor,  # noqa: F401  (registers "corridor")
    swe,  # noqa: F401  (registers "swe")
    textworld,  # noqa: F401  (registers "textworld")
    tool_task,  # noqa: F401  (registers "tools")
)
from lit_marl.envs.base import REGISTRY, Env
from lit_marl.tasks import import_object

__all__ = ["make_env"]


def make_env(name: str, kwargs: dict | None = None, field_name: str = "data.env") -> Env:
    """A registered environment by ``name``, or the ``Env`` subclass at an import path
    (``my_package.envs:MyEnv``: an environment of the user's own, no registration needed)."""
    if ":" in name:
        cls = import_object(name, field_name)
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise ConfigError(f"{field_name}={name!r} is not a subclass of lit_marl.envs.base.Env")
    elif name in REGISTRY:
        cls = REGISTRY[name]
    else:
        raise ConfigError(
            f"{field_name}={name!r}: not a registered environment; choose one of {sorted(REGISTRY)}, "
            "or give the import path of an Env subclass ('package.module:Class')"
        )
    try:
        return cls(**(kwargs or {}))
    except TypeError as err:
        raise ConfigError(f"{field_name}_kwargs={kwargs!r} do not fit environment {name!r}: {err}") from err
