"""SWE-Gym-style repositories fixed with tools over many turns (``env.py``); registers ``swe``."""

from lit_marl.envs.swe.env import SWEEnv

__all__ = ["SWEEnv"]
