"""Preference pairs from scored joint candidates (MADPO, the reward model of MARLHF). Pure: no models.

Per task, K joint candidates (agent i's k-th response in candidate k, ``joint_mode: aligned``) have
one reward each. Every ordered pair (w, l) with r_w - r_l > 0 is a preference of w over l; ties give
none (equal rewards say nothing about which is better). A candidate may appear in several pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.fields import PositiveInt, check_dataclass
from lit_marl.rollout.batch import AgentSamples, RolloutBatch

PairSelection = Literal["reward_gap", "random", "all"]
ComparisonSelection = Literal["comparator_reward", "reward_gap", "random", "all"]


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
        raise ValueError(
            f"selection='all' keeps every pair: max_pairs must be None (model.pairs.per_task: null), not {max_pairs}"
        )
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
        raise ValueError(f"model.pairs.selection={selection!r}: choose reward_gap, random or all")
    return pairs if max_pairs is None else pairs[:max_pairs]


def comparison_pairs(
    target: torch.Tensor,
    comparator: torch.Tensor,
    selection: ComparisonSelection = "comparator_reward",
    max_pairs: int | None = 16,
    generator: torch.Generator | None = None,
) -> list[tuple[int, bool]]:
    """One task's pairs of the policy's candidate k against the comparator's candidate k (index-
    aligned, iterative preference training): ``(k, target_wins)`` from their ``[K]`` rewards, the
    higher reward chosen; ties and non-finite rewards give none, so each candidate is in at most one pair.

    - ``comparator_reward`` (CoMLRL's default for iterative training): the highest comparator
      rewards first, then the largest gaps;
    - ``reward_gap``: the largest gaps first; ``random``: a seeded random order; ``all``: every pair in k order.

    At most ``max_pairs`` (None: all; must be None with ``all``)."""
    if target.dim() != 1 or target.shape != comparator.shape:
        raise ValueError(f"rewards must be two [K] tensors, got {tuple(target.shape)} and {tuple(comparator.shape)}")
    if selection == "all" and max_pairs is not None:
        raise ValueError(
            f"selection='all' keeps every pair: max_pairs must be None (model.pairs.per_task: null), not {max_pairs}"
        )
    mine, theirs = target.double().tolist(), comparator.double().tolist()
    pairs = [k for k in range(len(mine)) if mine[k] != theirs[k] and _finite(mine[k]) and _finite(theirs[k])]
    gap = {k: abs(mine[k] - theirs[k]) for k in pairs}
    if selection == "comparator_reward":
        pairs.sort(key=lambda k: (theirs[k], gap[k]), reverse=True)  # stable: equal keys keep k order
    elif selection == "reward_gap":
        pairs.sort(key=lambda k: gap[k], reverse=True)
    elif selection == "random":
        pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=generator).tolist()]
    elif selection != "all":
        raise ValueError(f"model.pairs.selection={selection!r}: choose comparator_reward, reward_gap, random or all")
    pairs = pairs if max_pairs is None else pairs[:max_pairs]
    return [(k, mine[k] > theirs[k]) for k in pairs]


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


PAIR_FIELDS = frozenset({"selection", "per_task"})
"""The ``model.pairs`` fields: every preference family reads both."""


@dataclass(frozen=True)
class PairSettings:
    """Which preference pairs a task's candidates give (``model.pairs``): MADPO, IterativeMADPO and
    the reward model of MARLHF (``RewardModelFit``)."""

    selection: ComparisonSelection | None = None
    """Order of a task's pairs before the cap: ``reward_gap`` (the largest reward gaps first), ``random``
    (a seeded random subset), ``all`` (every pair; needs ``per_task: null``) or, for IterativeMADPO's
    policy against its comparator, ``comparator_reward`` (the best comparator candidates first, then the
    largest gaps). None: ``comparator_reward`` for IterativeMADPO (CoMLRL's default there), else ``reward_gap``."""
    per_task: PositiveInt | None = 16
    """At most this many pairs per task (CoMLRL's ``preference_pairs_per_sample``: a "sample" is a task; its
    iterative trainer's default is 4, where each of K candidates is in one pair at most); null: every pair."""

    def __post_init__(self):
        check_dataclass("model.pairs", self)
        if self.selection == "all" and self.per_task is not None:
            raise ConfigError(
                f"model.pairs.selection=all keeps every pair, but model.pairs.per_task={self.per_task}: set it to "
                "null (or choose reward_gap / random)"
            )

    def of(self, family: type) -> PairSettings:
        """The settings with ``family``'s selection where none is given (``family.comparator``: IterativeMADPO's
        ``comparator_reward``, else ``reward_gap``); ``comparator_reward`` is refused without a comparator."""
        comparator = getattr(family, "comparator", False)
        if self.selection == "comparator_reward" and not comparator:
            raise ConfigError(
                f"model.pairs.selection=comparator_reward orders pairs against a comparator's candidates, which "
                f"{family.__name__} does not have: choose reward_gap, random or all (or use IterativeMADPO)"
            )
        default = "comparator_reward" if comparator else "reward_gap"
        return self if self.selection is not None else replace(self, selection=default)


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
    rewards = candidate_rewards(batch)
    num_tasks = rewards.shape[0]
    K = rewards.shape[1]
    chosen, rejected, without = [], [], 0
    for task in range(num_tasks):
        pairs = select_pairs(rewards[task], settings.selection, settings.per_task, generator)
        without += not pairs
        chosen += [task * K + win for win, _ in pairs]
        rejected += [task * K + lose for _, lose in pairs]
    chosen, rejected = torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)
    flat = rewards.view(-1)
    return TaskPairs(chosen, rejected, flat[chosen] - flat[rejected], without)


@dataclass
class PreferenceSamples:
    """Pairs as training rows, per agent: row 2p holds pair p's chosen response, row 2p + 1 its
    rejected one (with its prompt), so pairs from different steps and iterations stack (replay)."""

    agents: list[AgentSamples]
    chosen_rewards: torch.Tensor  # [pairs] joint reward of the chosen candidate
    rejected_rewards: torch.Tensor  # [pairs]
    target_wins: torch.Tensor  # [pairs] bool: the policy's candidate is the chosen one

    def __len__(self) -> int:
        return len(self.chosen_rewards)

    @property
    def chosen(self) -> torch.Tensor:
        return torch.arange(len(self)) * 2

    @property
    def rejected(self) -> torch.Tensor:
        return torch.arange(len(self)) * 2 + 1

    @property
    def gaps(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    def select(self, pairs: torch.Tensor) -> "PreferenceSamples":
        rows = torch.stack([2 * pairs, 2 * pairs + 1], 1).flatten()
        return PreferenceSamples(
            [a.select(rows) for a in self.agents],
            self.chosen_rewards[pairs],
            self.rejected_rewards[pairs],
            self.target_wins[pairs],
        )

    @staticmethod
    def cat(parts: list["PreferenceSamples"], pad_ids: list[int]) -> "PreferenceSamples":
        """Pairs of several parts in order; each part's prompt groups stay its own."""
        parts = [p for p in parts if len(p)]
        if len(parts) == 1:
            return parts[0]
        agents = []
        for i, pad_id in enumerate(pad_ids):
            offset, shifted = 0, []
            for part in parts:
                samples = part.agents[i]
                shifted.append(replace(samples, group_ids=samples.group_ids - samples.group_ids.min() + offset))
                offset = int(shifted[-1].group_ids.max()) + 1
            agents.append(AgentSamples.cat(shifted, pad_id))
        fields = ("chosen_rewards", "rejected_rewards", "target_wins")
        return PreferenceSamples(agents, *(torch.cat([getattr(p, f) for p in parts]) for f in fields))

    def state_dict(self) -> dict:
        """Plain tensors only (a replay shard loads with ``weights_only``)."""
        return {
            "agents": [{k: v for k, v in vars(a).items() if v is not None} for a in self.agents],
            "chosen_rewards": self.chosen_rewards,
            "rejected_rewards": self.rejected_rewards,
            "target_wins": self.target_wins,
        }

    @staticmethod
    def from_state_dict(state: dict) -> "PreferenceSamples":
        agents = [AgentSamples(**a) for a in state["agents"]]
        return PreferenceSamples(agents, state["chosen_rewards"], state["rejected_rewards"], state["target_wins"])


def candidate_rewards(batch: RolloutBatch) -> torch.Tensor:
    """``[tasks, K]``: each joint candidate's reward, the team mean of its rows' returns (the
    processed task reward), of a single-turn aligned rollout (rows ``task * K + k``, node-major)."""
    num_tasks = int(batch.agents[0].group_ids.max()) + 1
    return torch.stack([s.returns.float().cpu() for s in batch.agents]).mean(0).view(num_tasks, -1)


def comparison_rows(
    batch: RolloutBatch,
    comparator: RolloutBatch,
    settings: PairSettings,
    generator: torch.Generator,
    pad_ids: list[int],
) -> tuple[PreferenceSamples, int]:
    """The pairs of the policy's candidates (``batch``) against the comparator's (``comparator``,
    the same tasks and K) by ``comparison_pairs``, as rows; and the number of tasks without a pair.
    Both rollouts must have rendered every prompt to the same tokens (one tokenizer and template):
    a pair's two responses then answer exactly one prompt."""
    mine, theirs = candidate_rewards(batch), candidate_rewards(comparator)
    if mine.shape != theirs.shape:
        raise ValueError(
            f"the comparator answered {tuple(theirs.shape)} tasks x candidates, the policy {tuple(mine.shape)}"
        )
    num_tasks, K = mine.shape
    for i, (a, b) in enumerate(zip(batch.agents, comparator.agents)):
        if _prompts(a, K) != _prompts(b, K):
            raise ValueError(
                f"agent {i}: the comparator's prompts render to other tokens than the policy's (another tokenizer, "
                "chat template or system prompt): a preference pair must answer one prompt"
            )
    rows, wins, without = [], [], 0
    for task in range(num_tasks):
        pairs = comparison_pairs(mine[task], theirs[task], settings.selection, settings.per_task, generator)
        without += not pairs
        for k, target_wins in sorted(pairs):  # by k: a task's rows stay together (one prompt pass)
            row = task * K + k
            ours, other = row, num_tasks * K + row  # the comparator's rows follow the policy's
            rows += [ours, other] if target_wins else [other, ours]
            wins.append(target_wins)
    rows = torch.tensor(rows, dtype=torch.long)
    tasks = torch.arange(num_tasks).repeat_interleave(K)  # a task's rows, both sources: one prompt group
    agents = [
        AgentSamples.cat([replace(a, group_ids=tasks), replace(b, group_ids=tasks)], pad)
        for a, b, pad in zip(batch.agents, comparator.agents, pad_ids)
    ]
    flat = torch.cat([mine.view(-1), theirs.view(-1)])
    out = PreferenceSamples(
        [a.select(rows) for a in agents], flat[rows[0::2]], flat[rows[1::2]], torch.tensor(wins, dtype=torch.bool)
    )
    return out, without


def _prompts(samples: AgentSamples, K: int) -> list[list[int]]:
    """Each task's prompt tokens (its first candidate's row, padding dropped)."""
    width = samples.input_ids.shape[1] - samples.num_completion
    ids, mask = samples.input_ids[::K, :width], samples.attention_mask[::K, :width].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def check_candidate_rollouts(rollout, algorithm: str) -> None:
    """A preference algorithm needs single-turn aligned trees whose rewards were all computed
    (``rollout``: the data module's ``RolloutSettings``; None: nothing to check)."""
    if rollout is None:
        return
    rollout.require("tree", algorithm, "compares joint candidates of one turn")
    tree = rollout.tree
    if tree.num_turns != 1 or tree.joint_mode != "aligned":
        raise ConfigError(
            f"{algorithm} compares whole joint candidates of one turn: data.num_turns={tree.num_turns} and "
            f"data.joint_mode={tree.joint_mode!r}; set data.num_turns: 1 and data.joint_mode: aligned"
        )
    if rollout.on_reward_error == "skip":
        raise ConfigError(
            f"{algorithm} ranks candidates by their reward: data.reward_calls.on_reward_error=skip gives a failed "
            "reward its node's mean, which would rank it above every worse candidate; use "
            "data.reward_calls.on_reward_error: raise"
        )
