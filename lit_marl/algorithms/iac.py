"""IAC: independent actor-critic, a critic per agent (``actor_critic.ActorCritic`` does the work)."""

from __future__ import annotations

from typing import Literal

from lit_marl.algorithms.actor_critic import ActorCritic


class IAC(ActorCritic):
    """Independent actor-critic: each agent learns its own critic from its own reward (a value
    head on its actor, or a critic model). With ``policy_loss=ppo``: IPPO."""

    def __init__(self, critic: Literal["head", "model"] = "head", **kwargs):
        """
        Args:
            critic: ``head``: a value head on each actor; ``model``: a critic model per agent.
            **kwargs: See ``ActorCritic``.
        """
        super().__init__(critic=critic, **kwargs)
