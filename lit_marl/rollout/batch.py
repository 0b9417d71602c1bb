"""The row containers, in one vocabulary:

- a ``...Batch`` is what a rollout returns, its facts (``RolloutBatch``: a step's trees, each
  agent's rows and the trees' per-turn rewards and structure; ``rollout.episode.EpisodeBatch``:
  episodes, one token sequence per agent each);
- ``...Samples`` are training rows, what one loop of passes consumes: anything with ``input_ids``,
  ``attention_mask``, ``len`` and ``select(rows)`` (``Samples``). ``Rows`` is their base, with the
  one ``cat`` and ``select``: ``AgentSamples`` (an agent's responses in a tree),
  ``TrajectorySamples`` (whole episodes), ``rollout.demos.DemoSamples``,
  ``algorithms.critics.CriticInputs``; ``rollout.pairs.PreferenceSamples`` holds one
  ``AgentSamples`` per agent.

``pass_rows`` cuts any ``Samples`` into forward/backward passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, Protocol

import torch

from lit_marl.returns import CrossReduce, JointMode, joint_indices, per_response, tree_returns


class Samples(Protocol):
    """Training rows: what ``pass_rows`` and an optimizer step's passes take."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int: ...

    def select(self, rows: torch.Tensor) -> "Samples": ...


def pad_columns(value: torch.Tensor, left: int, right: int, fill: float = 0) -> torch.Tensor:
    """``value`` ``[B, W]`` with ``left`` columns of ``fill`` before and ``right`` after."""
    return torch.nn.functional.pad(value, (left, right), value=fill) if left or right else value


@dataclass
class Rows:
    """The base of the training-row containers: one tensor row per sample in every field (or None).

    A row's ``input_ids`` is a left-padded part (a prompt, or a whole episode) followed by
    ``num_completion`` right-padded positions (a response; none where a row is one sequence), so
    positions and masks keep their meaning whatever the rows are stacked with. Each field is one of:
    ``[B, L]`` laid out as ``input_ids`` (filled with the pad id for ``input_ids``, else 0); ``[B, C]``
    response positions (``completion_fields``, right-padded with 0); ``[B]`` one value per row, of
    which ``position_fields`` are column indices into ``input_ids`` (moved with the padding) and
    ``group_fields`` ids that ``cat`` keeps distinct per part. ``cat`` and ``select`` are the one
    stacking and slicing of every container.
    """

    completion_fields: ClassVar[tuple[str, ...]] = ()
    position_fields: ClassVar[tuple[str, ...]] = ()
    group_fields: ClassVar[tuple[str, ...]] = ()

    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def num_completion(self) -> int:
        return 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def cat(cls, parts: list, pad_id: int):
        """The rows of ``parts`` in order, each part padded to the widest prompt and response."""
        if len(parts) == 1:
            return parts[0]
        prompt = max(p.input_ids.shape[1] - p.num_completion for p in parts)
        completion = max(p.num_completion for p in parts)
        out, offset = {}, 0
        for name in (f.name for f in fields(cls)):
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):
                out[name] = None
                continue
            if name in cls.completion_fields:
                values = [pad_columns(v, 0, completion - v.shape[1]) for v in values]
            elif values[0].dim() == 2:
                fill = pad_id if name == "input_ids" else 0
                values = [
                    pad_columns(v, prompt - (v.shape[1] - p.num_completion), completion - p.num_completion, fill)
                    for v, p in zip(values, parts)
                ]
            elif name in cls.position_fields:
                values = [v + prompt - (p.input_ids.shape[1] - p.num_completion) for v, p in zip(values, parts)]
            elif name in cls.group_fields:
                renumbered = []
                for v in values:
                    renumbered.append(v - v.min() + offset if len(v) else v)
                    offset = int(renumbered[-1].max()) + 1 if len(v) else offset
                values = renumbered
            out[name] = torch.cat(values)
        return cls(**out)

    def select(self, rows: torch.Tensor):
        """The given rows, without the columns that are padding in all of them (on the left of the
        prompt part, on the right of the response)."""
        completion = self.num_completion
        prompt = self.input_ids.shape[1] - completion
        mask = self.attention_mask[rows]
        first = int((mask[:, :prompt].cumsum(-1) == 0).sum(-1).min()) if len(rows) and prompt else 0
        width = completion
        if completion:  # the longest response among the rows (at least one column)
            width = max(int(mask[:, prompt:].flip(-1).cumsum(-1).bool().sum(-1).max()), 1) if len(rows) else 1
        end = prompt + width
        out = {}
        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if value is None:
                out[name] = None
            elif name in self.completion_fields:
                out[name] = value[rows, :width]
            elif value.dim() == 2:
                out[name] = value[rows, first:end]
            elif name in self.position_fields:
                out[name] = value[rows] - first
            else:
                out[name] = value[rows]
        return type(self)(**out)


@dataclass
class AgentSamples(Rows):
    """One agent's sampled responses of a step: row r is prompt + response r.

    ``input_ids`` ends with the ``num_completion`` response positions; ``completion_mask`` marks the
    tokens the agent produced (end token included, padding excluded). ``returns`` holds each
    response's return and ``group_ids`` the tree node it was sampled at, so that group baselines
    compare siblings only. ``rewards`` and ``next_group`` are what one-step TD targets need: the
    response's immediate reward and the node its joint action led to.
    """

    completion_fields: ClassVar[tuple[str, ...]] = ("completion_mask", "rollout_logprobs", "old_logprobs")

    # input_ids, attention_mask: [B, P + C]
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

    def with_advantages(self, advantages: torch.Tensor) -> "AgentSamples":
        return replace(self, advantages=advantages)


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
class TrajectorySamples(Rows):
    """Whole multi-turn episodes as training rows, one token sequence each (left-padded).

    Per-token tensors are ``[B, L]`` and aligned with ``input_ids``: entry t belongs to token t
    (its log-prob is that of token t given the tokens before it); ``loss_mask`` marks the agent's
    own tokens. ``group_ids`` is the task of each episode (GRPO/RLOO groups, mini-batches keep a
    group together, ``cat`` keeps each part's groups its own); ``turn_ids`` is 0 for every row (a
    row is a whole episode)."""

    group_fields: ClassVar[tuple[str, ...]] = ("group_ids",)

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

    def loss_counts(self) -> tuple[float, float]:
        """What the two loss terms are means over: the action tokens and the value positions."""
        return float(self.loss_mask.sum()), float(self.value_mask.sum())


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
