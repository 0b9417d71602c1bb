"""MAAC: multi-agent actor-critic with one centralized critic (``actor_critic.ActorCritic`` does the work)."""

from __future__ import annotations

from typing import Literal

from lit_marl.algorithms.actor_critic import ActorCritic
from lit_marl.fields import check_fields


class MAAC(ActorCritic):
    """Multi-agent actor-critic with one centralized critic over the joint state (and, for
    ``critic.type: q``, the joint action), trained once per mini-batch - not once per agent - on the
    team reward; every agent's advantage comes from it. With ``policy_loss=ppo``: MAPPO."""

    centralized = True

    def __init__(
        self,
        critic_reward: Literal["team", "per_agent"] = "team",
        critic_updates: Literal["once", "per_agent"] = "once",
        **kwargs,
    ):
        """
        Args:
            critic_reward: TD targets of the ``team`` reward (the mean over agents: one target per
                node, what a centralized V(s) of the joint state can fit), or ``per_agent``: each
                agent's own reward and advantage (CoMLRL's), the critic fitting each in turn.
            critic_updates: The critic steps ``once`` per mini-batch, or once per agent on that
                agent's targets (``per_agent``, CoMLRL's: N times the critic steps).
            **kwargs: See ``ActorCritic``.
        """
        super().__init__(**kwargs)
        check_fields("model", MAAC.__init__, locals())
        self.critic_reward, self.critic_updates = critic_reward, critic_updates
