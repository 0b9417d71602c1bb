"""Multi-turn episodes in stateful environments, token-in / token-out.

Every episode is one token sequence: the first observation rendered with the chat template, then
per turn the sampled reply tokens exactly as generated (end-of-turn token included) and the next
observation as the chat template's new segment only (``Agent.chat_continuation``). What training
sees is therefore exactly what the model conditioned on and produced; the assistant's text is
never re-tokenized. Per turn there is ONE batched generate over all live episodes of the step and
the environments step in parallel.

Budgets: ``max_turns``; ``max_new_tokens`` per reply; ``max_context_tokens`` for the whole
sequence: when the next observation plus a reply would not fit, the episode ends as
``truncated`` (its reward is what it earned so far, never dropped).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from lit_marl.agents import Agent
from lit_marl.envs.base import Env, StepResult, step_all
from lit_marl.generation import generate, left_pad


@dataclass
class EpisodeBatch:
    """G episodes per task, consecutive rows; ``[B, L]`` tensors are left-padded."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    """1 on the agent's sampled tokens (end-of-turn included), 0 on prompts, observations, padding."""
    end_positions: torch.Tensor
    """``[B, T]``: index in the row of each turn's last sampled token; -1 after the episode's end."""
    scores: torch.Tensor
    """``[B, T]``: the env's cumulative score after each turn (carried after the end)."""
    won: torch.Tensor
    lost: torch.Tensor
    truncated: torch.Tensor
    max_score: torch.Tensor
    num_turns: torch.Tensor
    group_ids: torch.Tensor
    replies: list[list[str]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    rewards: torch.Tensor | None = None
    """``[B, T]`` each turn's reward, set from ``scores``/``won`` by the data module's reward density."""

    @property
    def alive(self) -> torch.Tensor:
        """``[B, T]``: whether the episode played turn t."""
        return self.end_positions >= 0

    def turn_ids(self) -> torch.Tensor:
        """``[B, L]``: the turn each sampled token belongs to, -1 elsewhere."""
        out = torch.full_like(self.input_ids, -1)
        positions = torch.arange(self.input_ids.shape[1])
        for t in range(self.end_positions.shape[1] - 1, -1, -1):
            end = self.end_positions[:, t : t + 1]
            out = torch.where((positions <= end) & (end >= 0) & self.loss_mask.bool(), t, out)
        return out

    def token_rewards(self, turn_rewards: torch.Tensor) -> torch.Tensor:
        """Each turn's reward ``[B, T]`` on that turn's last sampled token, ``[B, L]``."""
        out = torch.zeros(self.input_ids.shape, dtype=torch.float32)
        rows, turns = torch.nonzero(self.alive, as_tuple=True)
        out[rows, self.end_positions[rows, turns]] = turn_rewards[rows, turns].float()
        return out


@dataclass
class _Live:
    env: Env
    ids: list[int]
    mask: list[int]
    ends: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    done: bool = False
    truncated: bool = False


def run_episodes(
    agent: Agent,
    tasks: list[dict],
    make_env: Callable[[], Env],
    group_size: int = 1,
    max_turns: int = 8,
    max_new_tokens: int = 32,
    max_context_tokens: int = 2048,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    pool: ThreadPoolExecutor | None = None,
) -> EpisodeBatch:
    """``group_size`` episodes per task from the same start; returns them as one batch."""
    start = time.perf_counter()
    episodes = [_Live(make_env(), [], []) for _ in tasks for _ in range(group_size)]
    rows = [task for task in tasks for _ in range(group_size)]
    first = (
        list(pool.map(lambda pair: pair[0].env.reset(pair[1]), zip(episodes, rows)))
        if pool
        else [e.env.reset(task) for e, task in zip(episodes, rows)]
    )
    for e, obs in zip(episodes, first):
        if e.env.num_agents != 1:
            raise ValueError(f"{type(e.env).__name__} has {e.env.num_agents} agents; episodes play one agent")
        e.ids = agent.encode_prompt(obs[0])
        e.mask = [0] * len(e.ids)
        if len(e.ids) + max_new_tokens > max_context_tokens:
            raise ValueError(
                f"the first observation takes {len(e.ids)} tokens: it leaves no room for a reply of "
                f"{max_new_tokens} within max_context_tokens={max_context_tokens}"
            )
    generate_s = env_s = 0.0
    generated = 0
    for turn in range(max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            break
        t0 = time.perf_counter()
        out = generate(agent, [e.ids for e in live], 1, max_new_tokens, temperature, top_p, greedy)
        texts = agent.decode(out.completion_ids, out.completion_mask)
        t1 = time.perf_counter()
        closed = []
        for e, ids, m, text in zip(live, out.completion_ids, out.completion_mask, texts):
            reply = ids[m.bool()].tolist()
            e.ids += reply
            e.mask += [1] * len(reply)
            e.ends.append(len(e.ids) - 1)
            e.replies.append(text)
            closed.append(reply[-1] == agent.eos_token_id)
            generated += len(reply)
        results: list[StepResult] = step_all([e.env for e in live], [[t] for t in texts], pool)
        t2 = time.perf_counter()
        for e, result, was_closed in zip(live, results, closed):
            e.info = result.info
            e.scores.append(float(result.info["score"]))
            if result.terminated or result.truncated or turn == max_turns - 1:
                e.done, e.truncated = True, not result.terminated
                continue
            segment = agent.chat_continuation(result.observations[0], was_closed)
            if len(e.ids) + len(segment) + max_new_tokens > max_context_tokens:
                e.done = e.truncated = True  # the overflow policy: end as truncated, keep its reward
                continue
            e.ids += segment
            e.mask += [0] * len(segment)
        generate_s += t1 - t0
        env_s += t2 - t1
    device = next(agent.model.parameters()).device
    input_ids, attention_mask = left_pad([e.ids for e in episodes], agent.pad_token_id, device)
    loss_mask, _ = left_pad([e.mask for e in episodes], 0, device)
    width = input_ids.shape[1]
    T = max(len(e.ends) for e in episodes)
    ends = torch.full((len(episodes), T), -1, dtype=torch.long)
    scores = torch.zeros(len(episodes), T)
    for b, e in enumerate(episodes):
        pad = width - len(e.ids)
        ends[b, : len(e.ends)] = torch.tensor(e.ends) + pad
        scores[b] = torch.tensor(e.scores + [e.scores[-1]] * (T - len(e.scores)))
    info = [e.info for e in episodes]
    seconds = time.perf_counter() - start
    return EpisodeBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        end_positions=ends,
        scores=scores,
        won=torch.tensor([bool(i["won"]) for i in info]),
        lost=torch.tensor([bool(i["lost"]) for i in info]),
        truncated=torch.tensor([e.truncated for e in episodes]),
        max_score=torch.tensor([float(i["max_score"]) for i in info]),
        num_turns=torch.tensor([len(e.ends) for e in episodes]),
        group_ids=torch.arange(len(tasks)).repeat_interleave(group_size),
        replies=[e.replies for e in episodes],
        stats={
            "time/generate_s": generate_s,
            "time/env_s": env_s,
            "time/rollout_s": seconds,
            "rollout/generated_tokens": float(generated),
            "rollout/tokens_per_s": generated / max(generate_s, 1e-9),
            "rollout/env_steps": float(sum(len(e.ends) for e in episodes)),
            "rollout/env_steps_per_s": sum(len(e.ends) for e in episodes) / max(seconds, 1e-9),
        },
    )
