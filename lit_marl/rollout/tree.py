"""Joint rollout tree, built breadth-first over turns.

At every open node each agent samples G responses; joint actions pair them (``aligned``: by
index, G per node, G^T leaves after T turns; ``cross``: Cartesian product, G^N per node,
G^(N*T) leaves). Per turn: ONE batched generate per agent over all open nodes of all tasks, ONE
reward call over all their joint actions. Each joint action of a non-terminal node opens a child
node whose prompts the external transition builds from that branch's own histories.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lit_marl.agents import Agent, roles_by_model
from lit_marl.generation import Engine, Generation, make_engine
from lit_marl.returns import cross_agent_returns, tree_returns
from lit_marl.rollout.batch import AgentSamples, RolloutBatch

JointMode = Literal["aligned", "cross"]
RewardFn = Callable[..., Sequence[float] | Mapping[str, Sequence[float]]]
Transition = Callable[..., Sequence[str]]


def joint_indices(num_agents: int, num_generations: int, joint_mode: JointMode) -> list[tuple[int, ...]]:
    """Response index of each agent for every joint action of one node."""
    if joint_mode == "aligned":
        return [(k,) * num_agents for k in range(num_generations)]
    if joint_mode == "cross":
        return list(itertools.product(range(num_generations), repeat=num_agents))
    raise ValueError(f"joint_mode={joint_mode!r}: choose aligned or cross")


class RewardError(ValueError):
    """The reward function raised, or scored a joint action NaN/inf."""


def _reward_once(reward_fn: RewardFn, agent_completions, tasks, turn, name) -> tuple[torch.Tensor, dict]:
    try:
        out = reward_fn(agent_completions=agent_completions, tasks=tasks)
    except Exception as err:
        raise RewardError(
            f"reward function {name} raised {type(err).__name__}: {err} at turn {turn} on tasks {tasks[:3]!r:.300}"
        ) from err
    extra = {}
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise ValueError(f"reward function {name} returned a mapping without the key 'reward'")
        extra = {k: v for k, v in out.items() if k != "reward"}
        out = out["reward"]
    try:
        rewards = torch.as_tensor([list(r) if isinstance(r, Sequence) else r for r in out], dtype=torch.float32)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"reward function {name} returned {out!r:.200}: give floats, or one list per joint action"
        ) from err
    num_agents = len(agent_completions)
    if rewards.dim() == 0 or len(rewards) != len(tasks):
        count = 0 if rewards.dim() == 0 else len(rewards)
        raise ValueError(
            f"reward function {name} returned {count} rewards for {len(tasks)} joint actions at turn {turn}"
        )
    if rewards.dim() > 2 or (rewards.dim() == 2 and rewards.shape[1] != num_agents):
        raise ValueError(
            f"reward function {name} returned rewards of shape {tuple(rewards.shape)} at turn {turn}: give one float "
            f"(joint reward) or {num_agents} floats (one per agent) for each joint action"
        )
    return rewards, extra


def call_reward(
    reward_fn: RewardFn,
    agent_completions: list[list[str]],
    tasks: list[dict],
    turn: int = 0,
    on_error: Literal["raise", "skip"] = "raise",
) -> tuple[torch.Tensor, dict[str, float]]:
    """One batched call; returns the rewards and the mean of each extra metric it reported.

    A reward function returns one float per joint action (a joint reward, shared by the agents) or
    one list of ``num_agents`` floats per joint action (per-agent rewards: ``[J]`` or ``[J, N]``
    comes back), or a mapping with key ``reward`` holding either and further per-joint-action
    metrics (e.g. the levels of a level-based reward).

    ``on_error="raise"`` stops on a reward that raises or is NaN/inf, naming the task and turn.
    ``"skip"`` isolates the culprits (after a raising batch call, one call per joint action),
    returns NaN for them and reports their fraction as ``skipped_reward_frac``; the tree then gives them
    a neutral reward.
    """
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    try:
        rewards, extra = _reward_once(reward_fn, agent_completions, tasks, turn, name)
    except RewardError:
        if on_error == "raise":
            raise
        scored = []
        for j in range(len(tasks)):
            one = [a[j : j + 1] for a in agent_completions]
            try:
                scored.append(_reward_once(reward_fn, one, tasks[j : j + 1], turn, name)[0][0])
            except RewardError:
                scored.append(None)
        width = next((r.shape for r in scored if r is not None), ())
        rewards = torch.stack([torch.full(width, float("nan")) if r is None else r for r in scored])
        extra = {}
    bad = ~torch.isfinite(rewards) if rewards.dim() == 1 else ~torch.isfinite(rewards).all(dim=1)
    if bad.any() and on_error == "raise":
        examples = [tasks[i] for i in torch.nonzero(bad).flatten().tolist()[:3]]
        raise RewardError(
            f"reward function {name} returned a non-finite reward (NaN/inf) at turn {turn}, e.g. for tasks "
            f"{examples!r:.300}; set data.on_reward_error=skip to skip such samples instead"
        )
    metrics = {}
    for key, values in extra.items():
        values = torch.as_tensor(list(values), dtype=torch.float32)
        metrics[key] = float(values[~bad].mean()) if (~bad).any() else 0.0
    if on_error == "skip":
        metrics["skipped_reward_frac"] = float(bad.float().mean())
    bad = bad.view(-1, *([1] * (rewards.dim() - 1)))
    return torch.where(bad, torch.full_like(rewards, float("nan")), rewards), metrics


def neutral_fill(rewards: torch.Tensor) -> torch.Tensor:
    """``[nodes, J, ...]`` rewards with NaN (skipped) entries replaced by the mean of their node's
    valid ones (0 if none), so a skipped sample gets no advantage and shifts no baseline."""
    valid = torch.isfinite(rewards)
    counts = valid.sum(dim=1, keepdim=True)
    means = torch.where(valid, rewards, 0.0).sum(dim=1, keepdim=True) / counts.clamp(min=1)
    return torch.where(valid, rewards, means.expand_as(rewards))


def per_response(values: torch.Tensor, joint_mode: JointMode, G: int) -> torch.Tensor:
    """``[nodes, J, agents]`` values of joint actions -> ``[agents, nodes, G]`` values of each
    agent's responses: in ``aligned`` mode joint action k is response k; in ``cross`` mode a
    response gets the mean over the joint actions that contain it."""
    if joint_mode == "aligned":
        return values.permute(2, 0, 1)
    num_agents = values.shape[2]
    return torch.stack(
        [
            torch.stack([cross_agent_returns(v[:, i].reshape((G,) * num_agents))[i] for v in values])
            for i in range(num_agents)
        ]
    )


@dataclass
class _Node:
    task: int
    prompt_history: list[list[str]]  # per agent; the last entry is this node's prompt
    response_history: list[list[str]]  # per agent; responses of the turns before this node


def call_transitions(
    transition: Transition,
    branches: list[tuple[_Node, list[str]]],
    tasks: list[dict],
    turn: int,
    batched: bool,
) -> list[list[str]]:
    """Next prompts of every branch of a turn: one call per branch, or one call for all of them
    (``batched``: every keyword argument is then a list over branches, and so is the result).
    A transition with a ``task`` parameter (an environment's) or ``**kwargs`` also gets the branch's task row."""
    parameters = inspect.signature(transition).parameters
    with_task = "task" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    kwargs = [
        dict(
            **({"task": tasks[node.task]} if with_task else {}),
            prompt=[history[0] for history in node.prompt_history],
            agent_completions=completions,
            prompt_history_per_agent=[list(h) for h in node.prompt_history],
            response_history_per_agent=[list(h) + [c] for h, c in zip(node.response_history, completions)],
        )
        for node, completions in branches
    ]
    num_agents = len(branches[0][1]) if branches else 0
    if batched:
        out = (
            transition(num_agents=num_agents, **{key: [k[key] for k in kwargs] for key in kwargs[0]}) if kwargs else []
        )
        if isinstance(out, str) or len(out) != len(branches):
            name = getattr(transition, "__qualname__", repr(transition))
            raise ValueError(f"batched transition {name} returned {len(out)} results for {len(branches)} branches")
    else:
        out = [transition(num_agents=num_agents, **k) for k in kwargs]
    for (node, _), prompts in zip(branches, out):
        if isinstance(prompts, str) or len(prompts) != num_agents or not all(isinstance(p, str) for p in prompts):
            name = getattr(transition, "__qualname__", repr(transition))
            raise ValueError(
                f"transition {name} must return {num_agents} strings (one prompt per agent); it returned "
                f"{prompts!r:.200} after turn {turn} of task {tasks[node.task]!r:.200}"
            )
    return [list(p) for p in out]


def build_tree(
    agents: list[Agent],
    tasks: list[dict],
    prompts: list[list[str]],
    reward_fn: RewardFn,
    num_generations: int,
    joint_mode: JointMode = "aligned",
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    num_turns: int = 1,
    transition: Transition | None = None,
    batched_transition: bool = False,
    discount: float = 1.0,
    early_termination_threshold: float | None = None,
    external_prompt_passthrough: bool = False,
    on_reward_error: Literal["raise", "skip"] = "raise",
    response_penalty: Callable[[int, Generation], torch.Tensor] | None = None,
    engine: Engine | None = None,
) -> RolloutBatch:
    """``prompts[t][i]`` is agent i's first-turn prompt text for task t.

    ``response_penalty(agent_index, generation)`` gives one value per generated response (e.g. the
    KL to a reference model), subtracted from that agent's immediate reward of every joint action
    the response is part of, before returns are computed. ``engine`` generates (default: ``auto``).
    """
    if num_turns > 1 and transition is None:
        raise ValueError(f"num_turns={num_turns} needs a transition that builds the next turn's prompts")
    num_agents, G = len(agents), num_generations
    engine = engine or make_engine("auto")
    combos = joint_indices(num_agents, G, joint_mode)
    combo_index = torch.tensor(combos)  # [J, agents]: each agent's response index in joint action j
    nodes = [_Node(t, [[p] for p in prompts[t]], [[] for _ in agents]) for t in range(len(tasks))]
    level_rewards, level_shaped, level_children, level_samples = [], [], [], []  # per turn
    metric_sums: dict[str, float] = {}
    turn_metrics: dict[str, float] = {}  # the reward's own metrics (e.g. levels) per turn
    all_completions: list[list[str]] = [[] for _ in agents]  # [agent][joint action of every turn]
    stats = dict.fromkeys(("time/generate_s", "time/reward_s", "time/penalty_s", "time/transition_s"), 0.0)
    stats["rollout/generated_tokens"] = stats["rollout/episodes"] = 0.0
    truncated = num_responses = 0
    for turn in range(num_turns):
        t0 = time.perf_counter()
        gens: list[Generation] = [None] * num_agents
        raw = turn > 0 and external_prompt_passthrough
        groups = roles_by_model(agents)  # ONE batched generation per model over all open nodes
        calls = []
        for roles in groups:
            agent = agents[roles[0]]
            encoded = [agent.encode_prompt(node.prompt_history[i][-1], raw=raw) for i in roles for node in nodes]
            calls.append((agent, encoded, G))
        outputs = engine.generate_team(calls, max_new_tokens, temperature, top_p, greedy)  # the models together
        for roles, generated in zip(groups, outputs):
            for r, i in enumerate(roles):  # a parameter-shared model played several roles at once
                gens[i] = generated.rows(slice(r * len(nodes) * G, (r + 1) * len(nodes) * G))
        texts = [agent.decode(g.completion_ids, g.completion_mask) for agent, g in zip(agents, gens)]
        t1 = time.perf_counter()

        agent_completions = [[] for _ in agents]
        joint_tasks = []
        for n, node in enumerate(nodes):
            for combo in combos:
                joint_tasks.append(tasks[node.task])
                for i, k in enumerate(combo):
                    agent_completions[i].append(texts[i][n * G + k])
        rewards, metrics = call_reward(reward_fn, agent_completions, joint_tasks, turn, on_reward_error)
        for i in range(num_agents):
            all_completions[i] += agent_completions[i]
        if rewards.dim() == 1:  # a joint reward is every agent's reward
            rewards = rewards.unsqueeze(1).expand(-1, num_agents)
        rewards = neutral_fill(rewards.reshape(len(nodes), len(combos), num_agents))
        t2 = time.perf_counter()
        shaped = rewards  # what returns are built from; logs and early termination use the task reward
        if response_penalty is not None:
            penalties = torch.stack(
                [
                    response_penalty(i, g).float().cpu().view(len(nodes), G)[:, combo_index[:, i]]
                    for i, g in enumerate(gens)
                ],
                dim=2,
            )  # [nodes, J, agents]
            shaped = rewards - penalties
            metric_sums["penalty"] = metric_sums.get("penalty", 0.0) + float(penalties.mean(dim=2).sum())
        t_penalty = time.perf_counter()

        for key, value in metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value * rewards.shape[0] * rewards.shape[1]
            turn_metrics[f"turn{turn}/{key}"] = value
        metric_sums[f"turn{turn}/reward"] = float(rewards.mean(dim=2).sum())
        stopped = torch.zeros(len(nodes), dtype=torch.bool)
        if early_termination_threshold is not None:
            stopped = rewards.mean(dim=(1, 2)) > early_termination_threshold
        children = torch.full(rewards.shape[:2], -1, dtype=torch.long)
        next_nodes = []
        if turn + 1 < num_turns:
            branches, parents = [], []
            for n, node in enumerate(nodes):
                if stopped[n]:
                    continue
                for j, combo in enumerate(combos):
                    branches.append((node, [texts[i][n * G + k] for i, k in enumerate(combo)]))
                    parents.append((n, j))
            child_prompts = call_transitions(transition, branches, tasks, turn, batched_transition)
            for (node, completions), (n, j), prompts_ in zip(branches, parents, child_prompts):
                children[n, j] = len(next_nodes)
                next_nodes.append(
                    _Node(
                        node.task,
                        [h + [p] for h, p in zip(node.prompt_history, prompts_)],
                        [h + [c] for h, c in zip(node.response_history, completions)],
                    )
                )
        t3 = time.perf_counter()

        level_rewards.append(rewards)
        level_shaped.append(shaped)
        level_children.append(children)
        level_samples.append(gens)
        stats["time/generate_s"] += t1 - t0
        stats["time/reward_s"] += t2 - t1
        stats["time/penalty_s"] += t_penalty - t2
        stats["time/transition_s"] += t3 - t_penalty
        stats["rollout/generated_tokens"] += sum(g.num_generated_tokens for g in gens)
        stats[f"rollout/turn{turn}_nodes"] = float(len(nodes))
        stats["rollout/episodes"] += float((children < 0).sum())  # joint actions that end a branch: leaves
        # a response without its end token hit max_new_tokens
        truncated += sum(int((~(g.completion_ids == a.eos_token_id).any(-1)).sum()) for a, g in zip(agents, gens))
        num_responses += num_agents * len(nodes) * G
        nodes = next_nodes
        if not nodes:
            break

    returns = tree_returns(level_shaped, level_children, discount)
    samples_per_agent: list[list[AgentSamples]] = [[] for _ in agents]
    node_offset = 0
    for turn, (gens, level_returns) in enumerate(zip(level_samples, returns)):
        num_nodes = level_returns.shape[0]  # level_returns: [nodes, J, agents]
        metric_sums[f"turn{turn}/return"] = float(level_returns.mean(dim=2).sum())
        metric_sums[f"turn{turn}/joint_actions"] = float(num_nodes * level_returns.shape[1])
        response_returns = per_response(level_returns, joint_mode, G)
        response_rewards = per_response(level_shaped[turn], joint_mode, G)
        children = level_children[turn]  # [nodes, J]: the child node of each joint action
        if joint_mode == "aligned" or G == 1:  # joint action k holds response k of every agent
            next_group = torch.where(children >= 0, children + node_offset + num_nodes, -1).reshape(-1)
        else:
            next_group = torch.full((num_nodes * G,), -1, dtype=torch.long)
        for i, g in enumerate(gens):
            device = g.completion_ids.device
            samples_per_agent[i].append(
                AgentSamples(
                    input_ids=torch.cat([g.prompt_ids, g.completion_ids], dim=1),
                    attention_mask=torch.cat([g.prompt_mask, g.completion_mask], dim=1),
                    completion_mask=g.completion_mask,
                    returns=response_returns[i].reshape(-1).to(device),
                    group_ids=node_offset + torch.arange(num_nodes, device=device).repeat_interleave(G),
                    turn_ids=torch.full((num_nodes * G,), turn, device=device),
                    rewards=response_rewards[i].reshape(-1).to(device),
                    next_group=next_group.to(device),
                )
            )
        node_offset += num_nodes

    all_rewards = torch.cat([r.mean(dim=2).reshape(-1) for r in level_rewards])  # team mean per joint action
    metrics = dict(turn_metrics)
    for key, total in metric_sums.items():
        if key.startswith("turn"):
            continue
        metrics[key] = total / all_rewards.numel()
    for turn in range(len(level_rewards)):
        count = metric_sums[f"turn{turn}/joint_actions"]
        metrics[f"turn{turn}/reward"] = metric_sums[f"turn{turn}/reward"] / count
        metrics[f"turn{turn}/return"] = metric_sums[f"turn{turn}/return"] / count
    stats["rollout/tokens_per_s"] = stats["rollout/generated_tokens"] / max(stats["time/generate_s"], 1e-9)
    stats["rollout/truncated_frac"] = truncated / num_responses
    stats["rollout/completion_len"] = stats["rollout/generated_tokens"] / num_responses
    return RolloutBatch(
        agents=[AgentSamples.cat(parts, agent.pad_token_id) for parts, agent in zip(samples_per_agent, agents)],
        rewards=all_rewards,
        metrics=metrics,
        stats=stats,
        completions=all_completions,
    )
