"""Preference pairs from scored joint candidates (MADPO, the reward model of MARLHF). Pure: no models.

Per task, K joint candidates (agent i's k-th response in candidate k, ``joint_mode: aligned``) have
one reward each. Every ordered pair (w, l) with r_w - r_l > 0 is a preference of w over l; ties give
none (equal rewards say nothing about which is better). A candidate may appear in several pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.rollout.batch import RolloutBatch

PairSelection = Literal["reward_gap", "random", "all"]


def select_pairs(
    rewards: torch.Tensor,
    selection: PairSelection = "reward_gap",
    max_pairs: int | None = 16,
    generator: torch.Generator | None = None,
) -> list[tuple[int, int]]:
    """The (chosen, rejected) candidate indices of one task from its ``[K]`` rewards.

    - ``reward_gap``: the pairs with the largest gaps first (equal gaps in (w, l) order), at most ``max_pairs``.
    - ``random``: a uniformly random subset of ``max_pairs`` pairs, drawn with ``generator`` (seeded:
      the same pairs for the same rewards and generator state).
    - ``all``: every pair, in (w, l) order; ``max_pairs`` must be None (CoMLRL's rule).

    Ties (a zero gap) and non-finite rewards never pair."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [K] (one task's candidates), got shape {tuple(rewards.shape)}")
    if selection == "all" and max_pairs is not None:
        raise ValueError(f"pair_selection='all' keeps every pair: max_pairs_per_task must be null, got {max_pairs}")
    values = rewards.double().tolist()
    pairs = [
        (win, lose)
        for win in range(len(values))
        for lose in range(len(values))
        if values[win] - values[lose] > 0 and _finite(values[win]) and _finite(values[lose])
    ]
    if selection == "reward_gap":
        pairs.sort(key=lambda p: values[p[0]] - values[p[1]], reverse=True)  # stable: ties keep (w, l) order
    elif selection == "random":
        order = torch.randperm(len(pairs), generator=generator).tolist()
        pairs = [pairs[i] for i in order]
    elif selection != "all":
        raise ValueError(f"pair_selection={selection!r}: choose reward_gap, random or all")
    return pairs if max_pairs is None else pairs[:max_pairs]


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


@dataclass(frozen=True)
class PairSettings:
    """How a preference algorithm (MADPO, RewardModelFit) picks its pairs: ``select_pairs``'s settings."""

    selection: PairSelection = "reward_gap"
    max_pairs: int | None = 16

    def __post_init__(self):
        if self.selection == "all" and self.max_pairs is not None:
            raise ConfigError(
                f"model.pair_selection=all keeps every pair, but model.preference_pairs_per_sample="
                f"{self.max_pairs}: set it to null (or choose reward_gap / random)"
            )


@dataclass
class TaskPairs:
    """The pairs of one rollout's candidates: rows ``task * K + k`` of every agent's samples."""

    chosen: torch.Tensor  # [pairs]
    rejected: torch.Tensor  # [pairs]
    gaps: torch.Tensor  # [pairs] r_chosen - r_rejected
    tasks_without_pairs: int  # tasks whose candidates all tied


def rollout_pairs(batch: RolloutBatch, settings: PairSettings, generator: torch.Generator) -> TaskPairs:
    """Every task's pairs of a single-turn aligned rollout (K candidates per task, node-major). A
    joint candidate's reward is the team mean of its rows' returns (the processed task reward)."""
    num_tasks = int(batch.agents[0].group_ids.max()) + 1
    rewards = torch.stack([s.returns.float().cpu() for s in batch.agents]).mean(0).view(num_tasks, -1)
    K = rewards.shape[1]
    chosen, rejected, without = [], [], 0
    for task in range(num_tasks):
        pairs = select_pairs(rewards[task], settings.selection, settings.max_pairs, generator)
        without += not pairs
        chosen += [task * K + win for win, _ in pairs]
        rejected += [task * K + lose for _, lose in pairs]
    chosen, rejected = torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)
    flat = rewards.view(-1)
    return TaskPairs(chosen, rejected, flat[chosen] - flat[rejected], without)


def check_candidate_rollouts(datamodule, algorithm: str) -> None:
    """A preference algorithm needs single-turn aligned trees whose rewards were all computed."""
    tree = getattr(datamodule, "tree", None)  # episodes have none
    if tree is None:
        raise ConfigError(
            f"{algorithm} compares joint candidates of one turn: use data: lit_marl.data.RolloutDataModule"
        )
    if tree.num_turns != 1 or tree.joint_mode != "aligned":
        raise ConfigError(
            f"{algorithm} compares whole joint candidates of one turn: data.num_turns={tree.num_turns} and "
            f"data.joint_mode={tree.joint_mode!r}; set data.num_turns: 1 and data.joint_mode: aligned"
        )
    if tree.on_reward_error == "skip":
        raise ConfigError(
            f"{algorithm} ranks candidates by their reward: data.on_reward_error=skip gives a failed reward its "
            "node's mean, which would rank it above every worse candidate; use data.on_reward_error: raise"
        )
