"""Joint rollout trees: joint-action layout, one reward call per turn, per-agent returns."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from helpers import tree_from_functions
from lit_marl.envs.calls import call_reward
from lit_marl.generation import Sampling
from lit_marl.rollout.tree import joint_indices

TASKS = [{"topic": "tea"}, {"topic": "a rocket launch"}, {"topic": "winter"}]


def _text_score(text: str) -> int:
    return sum(ord(c) for c in text)


class CountingReward:
    """Deterministic joint reward that depends on every agent's text, counting its calls."""

    def __init__(self):
        self.calls = 0
        self.last = None

    def __call__(self, agent_completions, tasks):
        self.calls += 1
        self.last = (agent_completions, tasks)
        return [self.score([agent[j] for agent in agent_completions]) for j in range(len(tasks))]

    @staticmethod
    def score(lines: list[str]) -> float:
        return float(sum((2 * i + 3) * _text_score(line) for i, line in enumerate(lines)) % 101)


def _prompts(num_agents: int) -> list[list[str]]:
    return [[f"agent {i}: write about {t['topic']}" for i in range(num_agents)] for t in TASKS]


def _decoded(agent, samples) -> list[str]:
    C = samples.num_completion
    return agent.decode(samples.input_ids[:, -C:], samples.completion_mask)


# --------------------------------------------------------------------------- joint_indices
@pytest.mark.parametrize("num_agents, G", [(1, 3), (2, 2), (2, 4), (3, 2)])
def test_joint_indices_aligned(num_agents, G):
    combos = joint_indices(num_agents, G, "aligned")
    assert len(combos) == G
    assert combos == [(k,) * num_agents for k in range(G)]


@pytest.mark.parametrize("num_agents, G", [(1, 3), (2, 2), (2, 3), (3, 2)])
def test_joint_indices_cross(num_agents, G):
    combos = joint_indices(num_agents, G, "cross")
    assert len(combos) == G**num_agents
    assert len(set(combos)) == len(combos)
    assert all(len(c) == num_agents and all(0 <= k < G for k in c) for c in combos)


def test_joint_indices_bad_mode():
    with pytest.raises(ValueError, match="joint_mode='both'"):
        joint_indices(2, 2, "both")


# --------------------------------------------------------------------------- build_tree
@pytest.mark.parametrize("joint_mode", ["aligned", "cross"])
def test_build_tree_two_agents(tiny_agents, joint_mode):
    torch.manual_seed(0)
    G, N, T = 2, 2, len(TASKS)
    reward = CountingReward()
    batch = tree_from_functions(
        tiny_agents,
        TASKS,
        _prompts(N),
        reward,
        num_generations=G,
        joint_mode=joint_mode,
        sampling=Sampling(max_new_tokens=4),
    )

    assert reward.calls == 1, "one batched reward call per turn"
    per_node = G if joint_mode == "aligned" else G**N
    assert batch.rewards.shape == (T * per_node,)
    completions, joint_tasks = reward.last
    assert len(completions) == N and all(len(c) == T * per_node for c in completions)
    assert joint_tasks == [task for task in TASKS for _ in range(per_node)]
    assert batch.completions == completions

    texts = [_decoded(agent, samples) for agent, samples in zip(tiny_agents, batch.agents)]
    combos = joint_indices(N, G, joint_mode)
    for t in range(T):
        for j, combo in enumerate(combos):
            leaf = t * per_node + j
            # the reward saw, for each agent, the response that the joint action names
            assert [completions[i][leaf] for i in range(N)] == [texts[i][t * G + k] for i, k in enumerate(combo)]
            assert batch.rewards[leaf] == CountingReward.score([texts[i][t * G + k] for i, k in enumerate(combo)])

    for i, samples in enumerate(batch.agents):
        assert len(samples) == T * G
        assert samples.group_ids.tolist() == [t for t in range(T) for _ in range(G)]
        assert samples.returns.shape == (T * G,)
        for t in range(T):
            for k in range(G):
                if joint_mode == "aligned":
                    expected = float(batch.rewards[t * G + k])
                else:  # mean over the joint actions that contain agent i's response k
                    leaves = [t * per_node + j for j, c in enumerate(combos) if c[i] == k]
                    assert len(leaves) == G ** (N - 1)
                    expected = sum(float(batch.rewards[leaf]) for leaf in leaves) / len(leaves)
                assert math.isclose(float(samples.returns[t * G + k]), expected, rel_tol=1e-6, abs_tol=1e-6)
        # the training rows are prompt + completion with a matching attention mask
        C = samples.num_completion
        assert torch.equal(samples.attention_mask[:, -C:], samples.completion_mask)
        prompt = tiny_agents[i].encode_prompt(_prompts(N)[1][i])
        row = samples.input_ids[G, :-C][samples.attention_mask[G, :-C].bool()]
        assert row.tolist() == prompt

    generated = sum(int(s.completion_mask.sum()) for s in batch.agents)
    assert batch.stats["perf/generated_tokens"] == generated
    assert 0.0 <= batch.stats["train/truncated_frac"] <= 1.0


def test_build_tree_cross_three_agents(tiny_agents, tiny_agent):
    torch.manual_seed(1)
    agents = [*tiny_agents, tiny_agent]
    G, N, T = 2, 3, len(TASKS)
    reward = CountingReward()
    batch = tree_from_functions(
        agents, TASKS, _prompts(N), reward, num_generations=G, joint_mode="cross", sampling=Sampling(max_new_tokens=3)
    )
    assert reward.calls == 1
    assert batch.rewards.shape == (T * G**N,)
    combos = list(itertools.product(range(G), repeat=N))
    for i, samples in enumerate(batch.agents):
        for t in range(T):
            for k in range(G):
                leaves = [t * G**N + j for j, c in enumerate(combos) if c[i] == k]
                expected = float(batch.rewards[leaves].mean())
                assert math.isclose(float(samples.returns[t * G + k]), expected, rel_tol=1e-6, abs_tol=1e-6)


def test_build_tree_passes_reward_metrics(tiny_agents):
    def reward(agent_completions, tasks):
        n = len(tasks)
        return {"reward": [float(j) for j in range(n)], "level": [1.0] * (n - 1) + [0.0]}

    batch = tree_from_functions(
        tiny_agents, TASKS, _prompts(2), reward, num_generations=2, sampling=Sampling(max_new_tokens=2)
    )
    assert batch.rewards.tolist() == [float(j) for j in range(6)]
    assert batch.metrics == {
        "level": pytest.approx(5 / 6),
        "turn_0/level": pytest.approx(5 / 6),  # each reported metric also per turn
        "turn_0/reward": pytest.approx(2.5),  # one turn: the return is the reward
        "turn_0/return": pytest.approx(2.5),
    }


# --------------------------------------------------------------------------- call_reward
def _tasks(n):
    return [{"id": j} for j in range(n)]


def test_call_reward_sequence():
    rewards, metrics = call_reward(lambda agent_completions, tasks: [0.5, 1], [["a", "b"]], _tasks(2))
    assert rewards.dtype == torch.float32 and rewards.tolist() == [0.5, 1.0]
    assert metrics == {}


def test_call_reward_mapping_metrics_are_averaged():
    def fn(agent_completions, tasks):
        return {"reward": [1.0, 0.0, 0.5, 0.5], "success": [1, 0, 0, 0], "len": [2.0, 4.0, 6.0, 8.0]}

    rewards, metrics = call_reward(fn, [["a"] * 4], _tasks(4))
    assert rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert metrics == {"success": pytest.approx(0.25), "len": pytest.approx(5.0)}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_call_reward_non_finite(bad):
    def nan_reward(agent_completions, tasks):
        return [1.0, bad]

    with pytest.raises(ValueError, match="non-finite") as err:
        call_reward(nan_reward, [["a", "b"]], _tasks(2))
    assert "nan_reward" in str(err.value)
    assert "{'id': 1}" in str(err.value)  # names the offending task


@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0, 3.0], []])
def test_call_reward_wrong_length(values):
    with pytest.raises(ValueError, match=f"returned {len(values)} rewards for 2 joint actions"):
        call_reward(lambda agent_completions, tasks: values, [["a", "b"]], _tasks(2))


def test_call_reward_mapping_without_reward():
    with pytest.raises(ValueError, match="without the key 'reward'"):
        call_reward(lambda agent_completions, tasks: {"score": [1.0, 2.0]}, [["a", "b"]], _tasks(2))
