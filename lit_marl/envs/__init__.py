"""Environments behind one protocol (``base.py``); stateful ones register by name."""

from lit_marl.envs import corridor  # noqa: F401  (registers "corridor")
