"""GRPO and RLOO on multi-turn episodes: G full episodes per task from the same start, the episode
return baselined across its group (mean or leave-one-out), optionally per turn for dense rewards
(return-to-go at turn t against the group's members still playing at t)."""

from __future__ import annotations

import torch

from lit_marl.algorithms.episodic import EpisodicModule
from lit_marl.returns import episode_group_advantages, returns_to_go


class GRPO(EpisodicModule):
    """GRPO on multi-turn episodes: G episodes per task, each return baselined by its group's mean (optionally
    per turn, ``turn_level_advantages``)."""

    baseline = "grpo"

    def __init__(self, turn_level_advantages: bool = False, advantage_normalization: bool = True, **kwargs):
        """
        Args:
            turn_level_advantages: Each turn's advantage from its return-to-go, baselined across the
                group at that turn (for dense rewards); otherwise the episode's return for every turn.
            advantage_normalization: Divide by the group's std (GRPO's scaling).
            **kwargs: The shared settings of ``EpisodicModule`` (model, clip_range, ppo_epochs, ...).
        """
        super().__init__(**kwargs)
        self.turn_level_advantages = turn_level_advantages
        self.advantage_normalization = advantage_normalization

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.require_groups(stage, "each episode with the other episodes of its task")

    def advantages(self, batch, token_rewards, samples, learner):
        alive = batch.alive
        per_turn = batch.per_turn(token_rewards.cpu())  # a KL-in-reward term included
        to_go = returns_to_go(per_turn, alive, self.discount)
        returns = to_go if self.turn_level_advantages else to_go[:, :1].expand_as(to_go) * alive
        group_size = int((batch.group_ids == batch.group_ids[0]).sum())
        turn_adv = episode_group_advantages(returns, alive, group_size, self.baseline, self.advantage_normalization)
        device = batch.input_ids.device
        zeros = torch.zeros(batch.input_ids.shape, device=device)
        return {
            **samples,
            "advantages": batch.to_tokens(turn_adv).to(device),
            "returns": zeros,
            "old_values": zeros,
            "value_mask": zeros,
        }


class RLOO(GRPO):
    """Leave-one-out baseline (unbiased), no std scaling by default."""

    baseline = "rloo"

    def __init__(self, advantage_normalization: bool = False, **kwargs):
        super().__init__(advantage_normalization=advantage_normalization, **kwargs)
