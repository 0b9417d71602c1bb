"""The row containers, in one vocabulary:

- a ``...Batch`` is what a rollout returns, its facts (``RolloutBatch``: a step's trees, each
  agent's rows and the trees' per-turn rewards and structure; ``rollout.episode.EpisodeBatch``:
  episodes, one token sequence per agent each);
- ``...Samples`` are training rows, what one loop of passes consumes: anything with ``input_ids``,
  ``attention_mask``, ``len`` and ``select(rows)`` (``Samples``): ``AgentSamples`` (an agent's
  responses in a tree), ``TrajectorySamples`` (whole episodes), ``rollout.demos.DemoSamples``,
  ``rollout.pairs.PreferenceSamples``, and the algorithms' own.

``pass_rows`` cuts any ``Samples`` into forward/backward passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from lit_marl.returns import CrossReduce, JointMode, joint_indices, per_response, tree_returns


class Samples(Protocol):
    """Training rows: what ``pass_rows`` and an optimizer step's passes take."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int: ...

    def select(self, rows: torch.Tensor) -> "Samples": ...


@dataclass
class AgentSamples:
    """One agent's sampled responses of a step: row r is prompt + response r.

    ``input_ids`` ends with the ``num_completion`` response positions; ``completion_mask`` marks the
    tokens the agent produced (end token included, padding excluded). ``returns`` holds each
    response's return and ``group_ids`` the tree node it was sampled at, so that group baselines
    compare siblings only. ``rewards`` and ``next_group`` are what one-step TD targets need: the
    response's immediate reward and the node its joint action led to.
    """

    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C]
    returns: torch.Tensor | None  # [B], set by the algorithm (``RolloutBatch.score``)
    group_ids: torch.Tensor  # [B] tree node of each row
    turn_ids: torch.Tensor  # [B] turn of that node
    advantages: torch.Tensor | None = None  # [B], set by the algorithm
    rewards: torch.Tensor | None = None  # [B] immediate (shaped) reward, before returns (``RolloutBatch.score``)
    # [B] the tree node (a group id) the row's joint action opened; -1: none (the branch ended, or
    # ambiguous: in cross mode with G > 1 a response takes part in several joint actions)
    next_group: torch.Tensor | None = None
    # [B, C] the rollout engine's log-prob of each sampled token (``Generation.logprobs``); None: not given
    rollout_logprobs: torch.Tensor | None = None
    # set by actor-critic updates: behaviour log-probs [B, C], critic values [B], TD targets [B]
    old_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    @property
    def num_completion(self) -> int:
        return self.completion_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def cat(parts: list["AgentSamples"], pad_id: int) -> "AgentSamples":
        """Stack samples of different prompt/completion widths (e.g. of several turns): prompts stay
        left-padded and completions right-padded, so positions and masks keep their meaning."""
        if len(parts) == 1:
            return parts[0]
        prompt_width = max(p.input_ids.shape[1] - p.num_completion for p in parts)
        completion_width = max(p.num_completion for p in parts)
        rows = sum(len(p) for p in parts)
        like = parts[0].input_ids
        input_ids = like.new_full((rows, prompt_width + completion_width), pad_id)
        attention_mask = like.new_zeros((rows, prompt_width + completion_width))
        start = 0
        for p in parts:
            end, P, C = start + len(p), p.input_ids.shape[1] - p.num_completion, p.num_completion
            input_ids[start:end, prompt_width - P : prompt_width + C] = p.input_ids
            attention_mask[start:end, prompt_width - P : prompt_width + C] = p.attention_mask
            start = end
        fields = dict(input_ids=input_ids, attention_mask=attention_mask)
        for name in _ROW_FIELDS:
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):
                fields[name] = None
            elif name in _COMPLETION_FIELDS:  # [B, C]: right-padded with zeros
                fields[name] = torch.cat(
                    [torch.nn.functional.pad(v, (0, completion_width - v.shape[1])) for v in values]
                )
            else:
                fields[name] = torch.cat(values)
        return AgentSamples(**fields)

    def with_advantages(self, advantages: torch.Tensor) -> "AgentSamples":
        return replace(self, advantages=advantages)

    def select(self, rows: torch.Tensor) -> "AgentSamples":
        """The given rows, trimmed of completion columns that are padding in all of them."""
        width = max(int(self.completion_mask[rows].sum(-1).max()), 1) if len(rows) else 1
        end = self.input_ids.shape[1] - (self.num_completion - width)
        fields = dict(input_ids=self.input_ids[rows, :end], attention_mask=self.attention_mask[rows, :end])
        for name in _ROW_FIELDS:
            value = getattr(self, name)
            if value is not None:
                value = value[rows, :width] if name in _COMPLETION_FIELDS else value[rows]
            fields[name] = value
        return AgentSamples(**fields)


# the per-row fields besides the token sequence; the [B, C] ones are aligned with the completion
_ROW_FIELDS = (
    "completion_mask",
    "returns",
    "group_ids",
    "turn_ids",
    "advantages",
    "rewards",
    "next_group",
    "rollout_logprobs",
    "old_logprobs",
    "old_values",
    "targets",
)
_COMPLETION_FIELDS = ("completion_mask", "rollout_logprobs", "old_logprobs")


@dataclass
class TreeLevels:
    """A tree's facts per turn, what returns are built from: ``shaped[t]`` ``[nodes, J, agents]`` each
    joint action's reward (the reward processor applied), ``children[t]`` ``[nodes, J]`` the index in
    turn t+1 of the node it opened (-1: none)."""

    shaped: list[torch.Tensor]
    children: list[torch.Tensor]
    joint_mode: JointMode
    num_generations: int
    cross_return: CrossReduce


@dataclass
class RolloutBatch:
    agents: list[AgentSamples]
    rewards: torch.Tensor  # [joint actions] immediate reward (mean over agents) of every joint action, turn by turn
    metrics: dict[str, float] = field(default_factory=dict)  # means over joint actions, for logging
    stats: dict[str, float] = field(default_factory=dict)  # timings and token counts
    completions: list[list[str]] = field(default_factory=list)  # [agent][joint action], as in rewards
    prompts: list[list[str]] = field(default_factory=list)  # [agent][joint action]: the prompt (text) it answered
    turn_rewards: list[torch.Tensor] = field(default_factory=list)  # ``rewards`` split by turn
    sample: str = ""  # the first task's tree rendered as Markdown, for TensorBoard's text tab
    leaf_tasks: torch.Tensor | None = None  # [leaves] the task of every branch's last joint action
    leaf_success: torch.Tensor | None = None  # [leaves] its ``success`` (or a game's ``won``); None: unreported
    reward_range: tuple[float, float] | None = None  # the task reward's known [min, max] (``data.reward_range``)
    comparator: "RolloutBatch | None" = None  # the same tasks rolled out by a comparator (iterative preference)
    levels: TreeLevels | None = None  # the tree's facts per turn, for ``score``

    def score(self, discount: float, penalties: list[torch.Tensor] | None = None) -> None:
        """Each response's return and immediate reward (the algorithm's: its ``discount`` between
        turns; ``penalties``: per agent one value per row, e.g. the KL to a reference, subtracted from
        the reward of every joint action the response is part of), and each turn's mean return."""
        if self.levels is None:  # rows built elsewhere (a replay) carry their returns
            if any(samples.returns is None for samples in self.agents):
                raise ValueError("RolloutBatch.score: a batch without tree levels must carry its returns")
            return
        levels, num_agents = self.levels, len(self.agents)
        G = levels.num_generations
        combos = torch.tensor(joint_indices(num_agents, G, levels.joint_mode))  # [J, agents]
        shaped, offset = [], 0
        for rewards in levels.shaped:
            if penalties is not None:
                rows = slice(offset, offset + rewards.shape[0] * G)
                cut = [p[rows].float().cpu().view(-1, G)[:, combos[:, i]] for i, p in enumerate(penalties)]
                penalty = torch.stack(cut, dim=2)
                self.metrics["penalty"] = self.metrics.get("penalty", 0.0) + float(penalty.mean(dim=2).sum())
                rewards = rewards - penalty
            offset += rewards.shape[0] * G
            shaped.append(rewards)
        if penalties is not None:
            self.metrics["penalty"] /= self.rewards.numel()
        returns = tree_returns(shaped, levels.children, discount)
        per_agent: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_agents)]
        for turn, (level_returns, rewards) in enumerate(zip(returns, shaped)):
            self.metrics[f"turn_{turn}/return"] = float(level_returns.mean(dim=2).mean())
            response_returns = per_response(level_returns, levels.joint_mode, G, levels.cross_return)
            response_rewards = per_response(rewards, levels.joint_mode, G)  # immediate: always the mean
            for i in range(num_agents):
                per_agent[i].append((response_returns[i].reshape(-1), response_rewards[i].reshape(-1)))
        for i, samples in enumerate(self.agents):
            device = samples.input_ids.device
            self.agents[i] = replace(
                samples,
                returns=torch.cat([r for r, _ in per_agent[i]]).to(device),
                rewards=torch.cat([r for _, r in per_agent[i]]).to(device),
            )


@dataclass
class TrajectorySamples:
    """Whole multi-turn episodes as training rows, one token sequence each (left-padded).

    Per-token tensors are ``[B, L]`` and aligned with ``input_ids``: entry t belongs to token t
    (its log-prob is that of token t given the tokens before it); ``loss_mask`` marks the agent's
    own tokens. ``group_ids`` is the task of each episode (GRPO/RLOO groups, mini-batches keep a
    group together); ``turn_ids`` is 0 for every row (a row is a whole episode)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    value_mask: torch.Tensor
    """Where the value loss applies: every action token (token-level GAE) or each turn's first one."""
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    """The rollout engine's log-prob of each sampled token (``EpisodeBatch.rollout_logprobs``)."""
    group_ids: torch.Tensor
    turn_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def loss_counts(self) -> tuple[float, float]:
        """What the two loss terms are means over: the action tokens and the value positions."""
        return float(self.loss_mask.sum()), float(self.value_mask.sum())

    @staticmethod
    def cat(parts: list["TrajectorySamples"], pad_id: int) -> "TrajectorySamples":
        """Stack rows of different widths (e.g. the sequences of several agents one model plays),
        left-padded; group ids stay distinct per part."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.input_ids.shape[1] for p in parts)
        fields = {}
        offset, group_parts = 0, []
        for p in parts:
            group_parts.append(p.group_ids + offset)
            offset += int(p.group_ids.max()) + 1
        for name in vars(parts[0]):
            values = [getattr(p, name) for p in parts]
            if values[0] is None:
                fields[name] = None
            elif values[0].dim() == 2:
                fill = pad_id if name == "input_ids" else 0
                fields[name] = torch.cat(
                    [torch.nn.functional.pad(v, (width - v.shape[1], 0), value=fill) for v in values]
                )
            else:
                fields[name] = torch.cat(values)
        fields["group_ids"] = torch.cat(group_parts)
        return TrajectorySamples(**fields)

    def select(self, rows: torch.Tensor) -> "TrajectorySamples":
        """The given rows, trimmed of the columns that are left padding in all of them."""
        first = int((self.attention_mask[rows].cumsum(-1) == 0).sum(-1).min())
        return TrajectorySamples(
            **{
                name: None if value is None else (value[rows, first:] if value.dim() == 2 else value[rows])
                for name, value in vars(self).items()
            }
        )


def pass_tokens(rows, shared_prompts: bool) -> int:
    """The tokens a training pass over ``rows`` computes: every row's, or with ``shared_prompts``
    (``completion_logprobs(prompt_groups=...)``) each node's prompt once and every row's completion."""
    if not shared_prompts:
        return int(rows.attention_mask.sum())
    prompt = rows.input_ids.shape[1] - rows.num_completion
    first = {}
    for row, group in enumerate(rows.group_ids.tolist()):
        first.setdefault(group, row)
    prompts = rows.attention_mask[list(first.values()), :prompt].sum()
    return int(prompts + rows.attention_mask[:, prompt:].sum())


def pass_rows(rows, token_budget: int | None, row_cap: int | None, shared_prompts: bool = False) -> list[torch.Tensor]:
    """Row indices of the forward/backward passes over ``rows`` (anything with ``input_ids``), in
    order, each filled with rows while it stays within ``token_budget`` tokens and ``row_cap`` rows
    (None: no limit; a row alone past the budget still gets its pass). A row costs its padded width;
    with ``shared_prompts`` (the loss runs each tree node's prompt once for its rows:
    ``completion_logprobs(prompt_groups=...)``) its completion width, plus the prompt width for the
    first row of its node in the pass, which is what the pass computes."""
    count, width = rows.input_ids.shape[0], rows.input_ids.shape[-1]
    budget = token_budget if token_budget is not None else math.inf
    cap = row_cap if row_cap is not None else count
    completion = rows.num_completion if shared_prompts else width
    groups = rows.group_ids.tolist() if shared_prompts else None
    bounds, start, cost = [0], 0, 0
    for i in range(count):
        opens_node = groups is None or i == start or groups[i] != groups[i - 1]
        row_cost = completion + (width - completion if opens_node else 0)
        if i > start and (cost + row_cost > budget or i - start >= cap):
            bounds.append(i)
            start, cost = i, 0
            row_cost = width  # the first row of a pass brings its node's prompt
        cost += row_cost
    bounds.append(count)
    return [torch.arange(a, b) for a, b in zip(bounds, bounds[1:])]


def length_passes(lengths: torch.Tensor, token_budget: int | None, row_cap: int | None) -> list[torch.Tensor]:
    """Row indices of the passes over left-padded rows of ``lengths`` tokens: as few passes as
    ``token_budget`` (tokens at a pass's longest row's width; a longer row alone) and ``row_cap``
    allow, and among those the fewest padded tokens. A pass is trimmed to its longest row, so rows of
    similar length go together: the rows, longest first, are cut into runs by an exact dynamic
    program over the cuts. The passes' gradients sum to the same gradient whatever the split."""
    order = torch.argsort(lengths.cpu(), descending=True, stable=True)
    width = lengths.cpu()[order].tolist()
    budget, cap = token_budget or math.inf, row_cap or len(width)
    best, cut = [(0, 0)] + [(math.inf, math.inf)] * len(width), [0] * (len(width) + 1)
    for end in range(1, len(width) + 1):
        for start in range(end - 1, -1, -1):  # rows start..end-1 in one pass, as wide as row start
            rows = end - start
            if rows > 1 and (rows > cap or rows * width[start] > budget):
                break
            cost = (best[start][0] + 1, best[start][1] + rows * width[start])  # (passes, padded tokens)
            if cost < best[end]:
                best[end], cut[end] = cost, start
    bounds, end = [], len(width)
    while end:
        bounds.append((cut[end], end))
        end = cut[end]
    return [order[a:b].to(lengths.device) for a, b in reversed(bounds)]
