"""TextWorld: generated text games of any complexity (``games``) played as a stateful ``Env`` (``env``)."""

from lit_marl.envs.textworld.env import TextWorldEnv

__all__ = ["TextWorldEnv"]
