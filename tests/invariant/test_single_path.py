"""A tree of one response per node (aligned, G=1) is a single trajectory: the turns played by hand."""

from __future__ import annotations

import pytest

from helpers import tree_from_functions
from lit_marl.generation import Sampling, generate
from lit_marl.rollout.transitions import plain

TASKS = [{"topic": "tea"}, {"topic": "winter"}]


def _prompts(num_agents: int) -> list[list[str]]:
    return [[f"agent {i}: write about {t['topic']}" for i in range(num_agents)] for t in TASKS]


def _len_reward(agent_completions, tasks):
    return [float(sum(len(agent[j]) for agent in agent_completions) % 7) for j in range(len(tasks))]


def test_single_response_tree_follows_sequential_turns(tiny_agents):
    """G=1 aligned, greedy: the tree is one path per task, identical to playing T turns by hand."""
    T = 3
    batch = tree_from_functions(
        tiny_agents,
        TASKS,
        _prompts(2),
        _len_reward,
        1,
        sampling=Sampling(max_new_tokens=4, greedy=True),
        num_turns=T,
        transition=plain,
    )
    expected = [[], []]
    expected_rewards = []
    for t, prompts in enumerate(_prompts(2)):
        histories = [[p] for p in prompts]
        responses = [[], []]
        current = list(prompts)
        for turn in range(T):
            texts = []
            for i, agent in enumerate(tiny_agents):
                g = generate(
                    agent, [agent.encode_prompt(current[i])], 1, sampling=Sampling(max_new_tokens=4, greedy=True)
                )
                texts.append(agent.decode(g.completion_ids, g.completion_mask)[0])
            expected_rewards.append((turn, t, _len_reward([[x] for x in texts], [TASKS[t]])[0]))
            for i in range(2):
                expected[i].append((turn, t, texts[i]))
                responses[i].append(texts[i])
            current = plain(
                prompt="",
                agent_completions=texts,
                num_agents=2,
                prompt_history_per_agent=histories,
                response_history_per_agent=responses,
            )
            histories = [h + [p] for h, p in zip(histories, current)]
    # the tree lists joint actions turn by turn, task by task within a turn
    for i in range(2):
        assert batch.completions[i] == [text for _, _, text in sorted(expected[i])]
    rewards = [r for _, _, r in sorted(expected_rewards)]
    assert batch.rewards.tolist() == rewards
    # undiscounted return of each turn = the rewards from that turn on
    by_task = {t: [r for turn, task, r in sorted(expected_rewards) if task == t] for t in range(len(TASKS))}
    returns = batch.agents[0].returns.tolist()  # rows: turn-major, task-minor (G=1)
    for turn in range(T):
        for t in range(len(TASKS)):
            assert returns[turn * len(TASKS) + t] == pytest.approx(sum(by_task[t][turn:]))
