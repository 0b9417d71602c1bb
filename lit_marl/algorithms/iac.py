"""IAC: independent actor-critic, a critic per agent (``actor_critic.ActorCritic`` does the work)."""

from __future__ import annotations

from lit_marl.algorithms.actor_critic import ActorCritic


class IAC(ActorCritic):
    """Independent actor-critic: each agent learns its own critic from its own reward (a value
    head on its actor, or a critic model: ``model.critic.kind``). With ``policy_loss=ppo``: IPPO."""
