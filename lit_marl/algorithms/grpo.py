"""GRPO and RLOO on multi-turn episodes: G full episodes per task from the same start, the episode
return baselined across its group (mean or leave-one-out), optionally per turn for dense rewards
(return-to-go at turn t against the group's returns-to-go at t), and optionally with GiGPO's
step-level part: a step's return-to-go against the other episodes' steps from the same anchor state
(``returns.step_group_advantages``; docs/credit.md shows each form unbiased)."""

from __future__ import annotations

import torch

from lit_marl import ConfigError
from lit_marl.algorithms.episodic import EpisodicModule
from lit_marl.returns import anchor_groups, episode_advantages


class GRPO(EpisodicModule):
    """GRPO on multi-turn episodes: G episodes per task, each return baselined by its group's mean (optionally
    per turn, ``model.advantage.turn_level``; optionally plus step-level groups, ``step_weight``)."""

    baseline = "grpo"

    advantage_fields = frozenset({"normalization", "turn_level", "step_weight"})
    """The ``model.advantage`` fields GRPO and RLOO read: ``normalization`` divides by the group's sample
    std (GRPO's scaling; also the step-level part's, by its anchor group's), ``turn_level`` baselines each
    turn's return-to-go (dense rewards), ``step_weight`` adds GiGPO's step-level groups."""
    normalizes = True
    """Whether ``model.advantage.normalization: null`` scales by the group's std."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.require_groups(stage, "each episode with the other episodes of its task")

    def advantages(self, samples, learner, batch, token_rewards, values=None):
        alive = batch.alive
        group_size = int((batch.group_ids == batch.group_ids[0]).sum())
        settings = self.advantage
        if settings.step_weight > 0:
            self.record_anchors(batch, group_size)
        turn_adv = episode_advantages(
            batch.per_turn(token_rewards.cpu()),  # a KL-in-reward term included
            alive,
            group_size,
            self.baseline,
            settings.normalized(self.normalizes),
            turn_level=settings.turn_level,
            anchors=batch.anchors,
            step_weight=settings.step_weight,
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
            raise ConfigError("model.advantage.step_weight > 0 needs episodes that record anchor states")
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
    normalizes = False
