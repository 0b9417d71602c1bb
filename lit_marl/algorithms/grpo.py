"""GRPO and RLOO on multi-turn episodes: G full episodes per task from the same start, the episode
return baselined across its group (mean or leave-one-out), optionally per turn for dense rewards
(return-to-go at turn t against the group's returns-to-go at t), and optionally with GiGPO's
step-level part: a step's return-to-go against the other episodes' steps from the same anchor state
(``returns.step_group_advantages``; docs/credit.md shows each form unbiased)."""

from __future__ import annotations

import torch

from lit_marl import ConfigError
from lit_marl.algorithms.episodic import EpisodicModule
from lit_marl.fields import NonNegativeFloat, check_fields
from lit_marl.returns import anchor_groups, episode_advantages


class GRPO(EpisodicModule):
    """GRPO on multi-turn episodes: G episodes per task, each return baselined by its group's mean (optionally
    per turn, ``turn_level_advantages``; optionally plus step-level groups, ``step_advantage_weight``)."""

    baseline = "grpo"

    def __init__(
        self,
        turn_level_advantages: bool = False,
        advantage_normalization: bool = True,
        step_advantage_weight: NonNegativeFloat = 0.0,
        **kwargs,
    ):
        """
        Args:
            turn_level_advantages: Each turn's advantage from its return-to-go, baselined across the
                group at that turn (a finished episode counting 0; for dense rewards); otherwise the
                episode's return for every turn.
            advantage_normalization: Divide by the group's sample std (GRPO's scaling, veRL's and TRL's;
                also the step-level part's, by its anchor group's).
            step_advantage_weight: GiGPO's omega: add this times the step-level advantage - the
                step's return-to-go against the other episodes' steps from the same anchor state
                (``data.anchor``) - to the episode-level one; a step no other episode shares keeps
                the episode-level part only (0: off, plain GRPO/RLOO).
            **kwargs: The shared settings of ``EpisodicModule`` (model, clip_range, ppo_epochs, ...).
        """
        super().__init__(**kwargs)
        check_fields("model", GRPO.__init__, locals())
        self.turn_level_advantages = turn_level_advantages
        self.advantage_normalization = advantage_normalization
        self.step_advantage_weight = step_advantage_weight

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.require_groups(stage, "each episode with the other episodes of its task")

    def advantages(self, samples, learner, batch, token_rewards, values=None):
        alive = batch.alive
        group_size = int((batch.group_ids == batch.group_ids[0]).sum())
        if self.step_advantage_weight > 0:
            self.record_anchors(batch, group_size)
        turn_adv = episode_advantages(
            batch.per_turn(token_rewards.cpu()),  # a KL-in-reward term included
            alive,
            group_size,
            self.baseline,
            self.advantage_normalization,
            turn_level=self.turn_level_advantages,
            anchors=batch.anchors,
            step_weight=self.step_advantage_weight,
            discount=self.discount,
        )
        device = batch.input_ids.device
        zeros = torch.zeros(batch.input_ids.shape, device=device)
        return {
            **samples,
            "advantages": batch.to_tokens(turn_adv).to(device),
            "returns": zeros,
            "old_values": zeros,
            "value_mask": zeros,
        }

    def record_anchors(self, batch, group_size: int) -> None:
        """How many steps found another episode's step from the same anchor state, and the groups' size."""
        if batch.anchors is None:
            raise ConfigError("model.step_advantage_weight > 0 needs episodes that record anchor states")
        alive = batch.alive
        shared = anchor_groups(batch.anchors, alive, group_size)
        grouped = shared > 0
        steps = float(alive.sum())
        self.record({"train/anchor_grouped_frac": float(grouped.sum()) / max(steps, 1.0)}, weight=steps)
        if grouped.any():
            self.record({"train/anchor_group_size": float((shared[grouped] + 1).float().mean())}, float(grouped.sum()))


class RLOO(GRPO):
    """Leave-one-out baseline (unbiased), no std scaling by default."""

    baseline = "rloo"

    def __init__(self, advantage_normalization: bool = False, **kwargs):
        super().__init__(advantage_normalization=advantage_normalization, **kwargs)
