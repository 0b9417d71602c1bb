"""ALFWorld's household tasks (text), on TextWorld's PDDL backend: the env and the game sets."""

from lit_marl.envs.alfworld.env import AlfWorldEnv

__all__ = ["AlfWorldEnv"]
