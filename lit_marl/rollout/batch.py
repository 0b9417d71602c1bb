"""The padded tensors that training steps consume, one block per agent."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class AgentSamples:
    """One agent's sampled responses of a step: row r is prompt + response r.

    ``input_ids`` ends with the ``num_completion`` response positions; ``completion_mask`` marks the
    tokens the agent produced (end token included, padding excluded). ``returns`` holds each
    response's return and ``group_ids`` the tree node it was sampled at, so that group baselines
    compare siblings only.
    """

    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C]
    returns: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B]
    advantages: torch.Tensor | None = None  # [B], set by the algorithm

    @property
    def num_completion(self) -> int:
        return self.completion_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def with_advantages(self, advantages: torch.Tensor) -> "AgentSamples":
        return replace(self, advantages=advantages)

    def select(self, rows: torch.Tensor) -> "AgentSamples":
        """The given rows, trimmed of completion columns that are padding in all of them."""
        width = max(int(self.completion_mask[rows].sum(-1).max()), 1)
        cut = self.num_completion - width
        end = self.input_ids.shape[1] - cut
        return AgentSamples(
            input_ids=self.input_ids[rows, :end],
            attention_mask=self.attention_mask[rows, :end],
            completion_mask=self.completion_mask[rows, :width],
            returns=self.returns[rows],
            group_ids=self.group_ids[rows],
            advantages=None if self.advantages is None else self.advantages[rows],
        )


@dataclass
class RolloutBatch:
    agents: list[AgentSamples]
    rewards: torch.Tensor  # [num_joint_actions] joint reward of each leaf
    metrics: dict[str, float] = field(default_factory=dict)  # means over joint actions, for logging
    stats: dict[str, float] = field(default_factory=dict)  # timings and token counts
    completions: list[list[str]] = field(default_factory=list)  # [agent][joint action], for logging
