"""Joint rollout tree (one turn so far): every agent samples G responses per task, joint actions
pair them (``aligned``: by index, G per task; ``cross``: Cartesian product, G^N per task), one
batched reward call scores all joint actions of the turn.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from lit_marl.agents import Agent
from lit_marl.generation import generate
from lit_marl.returns import cross_agent_returns
from lit_marl.rollout.batch import AgentSamples, RolloutBatch

JointMode = Literal["aligned", "cross"]
RewardFn = Callable[..., Sequence[float] | Mapping[str, Sequence[float]]]


def joint_indices(num_agents: int, num_generations: int, joint_mode: JointMode) -> list[tuple[int, ...]]:
    """Response index of each agent for every joint action of one node."""
    if joint_mode == "aligned":
        return [(k,) * num_agents for k in range(num_generations)]
    if joint_mode == "cross":
        return list(itertools.product(range(num_generations), repeat=num_agents))
    raise ValueError(f"joint_mode={joint_mode!r}: choose aligned or cross")


def call_reward(
    reward_fn: RewardFn, agent_completions: list[list[str]], tasks: list[dict]
) -> tuple[torch.Tensor, dict[str, float]]:
    """One batched call; returns the rewards and the mean of each extra metric it reported.

    A reward function returns one float per joint action, or a mapping with key ``reward`` and
    further per-joint-action metrics (e.g. the levels of a level-based reward).
    """
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    out = reward_fn(agent_completions=agent_completions, tasks=tasks)
    extra = {}
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise ValueError(f"reward function {name} returned a mapping without the key 'reward'")
        extra = {k: v for k, v in out.items() if k != "reward"}
        out = out["reward"]
    rewards = torch.as_tensor(list(out), dtype=torch.float32)
    if rewards.shape != (len(tasks),):
        raise ValueError(f"reward function {name} returned {rewards.numel()} rewards for {len(tasks)} joint actions")
    if not torch.isfinite(rewards).all():
        bad = [tasks[i] for i in torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()[:3]]
        raise ValueError(f"reward function {name} returned a non-finite reward (NaN/inf), e.g. for tasks {bad}")
    metrics = {k: float(torch.as_tensor(list(v), dtype=torch.float32).mean()) for k, v in extra.items()}
    return rewards, metrics


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
) -> RolloutBatch:
    """``prompts[t][i]`` is agent i's prompt text for task t."""
    num_agents, num_tasks, G = len(agents), len(tasks), num_generations
    t0 = time.perf_counter()
    gens = []
    for i, agent in enumerate(agents):  # ONE batched generate per agent for all tasks x G samples
        encoded = [agent.encode_prompt(p[i]) for p in prompts]
        gens.append(generate(agent, encoded, G, max_new_tokens, temperature, top_p, greedy))
    texts = [agent.decode(g.completion_ids, g.completion_mask) for agent, g in zip(agents, gens)]
    t1 = time.perf_counter()

    combos = joint_indices(num_agents, G, joint_mode)
    agent_completions = [[] for _ in agents]
    joint_tasks = []
    for t in range(num_tasks):
        for combo in combos:
            joint_tasks.append(tasks[t])
            for i, k in enumerate(combo):
                agent_completions[i].append(texts[i][t * G + k])
    rewards, metrics = call_reward(reward_fn, agent_completions, joint_tasks)
    t2 = time.perf_counter()

    if joint_mode == "aligned":
        per_agent_returns = rewards.view(num_tasks, G).unsqueeze(0).expand(num_agents, -1, -1)
    else:
        per_agent_returns = torch.stack(
            [cross_agent_returns(r.view((G,) * num_agents)) for r in rewards.view(num_tasks, -1)], dim=1
        )  # [num_agents, num_tasks, G]

    samples = []
    for i, g in enumerate(gens):
        device = g.completion_ids.device
        samples.append(
            AgentSamples(
                input_ids=torch.cat([g.prompt_ids, g.completion_ids], dim=1),
                attention_mask=torch.cat([g.prompt_mask, g.completion_mask], dim=1),
                completion_mask=g.completion_mask,
                returns=per_agent_returns[i].reshape(-1).to(device),
                group_ids=torch.arange(num_tasks, device=device).repeat_interleave(G),
            )
        )
    generated = sum(g.num_generated_tokens for g in gens)
    # a response without its end token hit max_new_tokens
    truncated = sum(int((~(g.completion_ids == a.eos_token_id).any(-1)).sum()) for a, g in zip(agents, gens))
    stats = {
        "time/generate_s": t1 - t0,
        "time/reward_s": t2 - t1,
        "rollout/generated_tokens": float(generated),
        "rollout/tokens_per_s": generated / max(t1 - t0, 1e-9),
        "rollout/truncated_frac": truncated / (num_agents * num_tasks * G),
        "rollout/completion_len": generated / max(1, num_agents * num_tasks * G),
    }
    return RolloutBatch(agents=samples, rewards=rewards, metrics=metrics, stats=stats, completions=agent_completions)
