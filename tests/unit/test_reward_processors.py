"""Reward processors (``lit_marl/envs/processors.py``): each formula by hand, composition, ranges,
config errors, and that trees build returns from the processed reward while logging the task's."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import SLOGAN_PROMPTS, slogan_data, tree_from_functions
from lit_marl import ConfigError
from lit_marl.envs.processors import RewardProcessor
from lit_marl.generation import Sampling

T = torch.tensor


def process(spec, rewards, lengths=None):
    return RewardProcessor.parse(spec)(T(rewards, dtype=torch.float32), lengths).tolist()


def test_each_kind_by_hand():
    r = [-3.0, 0.0, 0.5, 20.0]
    assert process([{"kind": "identity"}], r) == r
    assert process([{"kind": "clamp", "min": -1, "max": 1}], r) == [-1.0, 0.0, 0.5, 1.0]
    assert process([{"kind": "clamp"}], r) == [-3.0, 0.0, 0.5, 10.0]  # CoMLRL's default bounds +-10
    assert process([{"kind": "scale", "factor": -2}], r) == [6.0, 0.0, -1.0, -40.0]
    assert process([{"kind": "shift", "offset": 0.25}], r) == [-2.75, 0.25, 0.75, 20.25]
    assert process([{"kind": "sigmoid_scale"}], r) == pytest.approx([1 / (1 + math.exp(-x)) for x in r])
    lengths = T([50.0, 100.0, 200.0, 0.0])
    assert process([{"kind": "normalize_by_length", "max_len": 100}], [1.0, 1.0, 1.0, 1.0], lengths) == [
        0.5,
        1.0,
        1.0,  # min(1, L / max_len): long answers keep the reward
        0.0,
    ]


def test_steps_compose_in_order():
    spec = [
        {"kind": "shift", "offset": -0.5},
        {"kind": "scale", "factor": 2},
        {"kind": "clamp", "min": -0.5, "max": 0.5},
    ]
    assert process(spec, [0.0, 0.5, 0.7, 1.0]) == pytest.approx([-0.5, 0.0, 0.4, 0.5])
    assert process(list(reversed(spec)), [0.0, 0.5, 0.7, 1.0]) == pytest.approx([-0.5, 0.5, 0.5, 0.5])


def test_an_empty_or_identity_processor_is_falsy():
    assert not RewardProcessor.parse(None)
    assert not RewardProcessor.parse([{"kind": "identity"}])
    assert RewardProcessor.parse([{"kind": "scale", "factor": 1}])


@pytest.mark.parametrize(
    "spec, message",
    [
        ([{"kind": "tanh"}], r"data.reward_processor\[0\].kind='tanh': choose one of"),
        ([{"factor": 2}], r"data.reward_processor\[0\]=.*give a mapping with `kind`"),
        ([{"kind": "scale", "offset": 1}], r"data.reward_processor\[0\]: scale takes \['factor'\], not \['offset'\]"),
        (
            [{"kind": "identity"}, {"kind": "shift", "offset": "1"}],
            r"data.reward_processor\[1\].offset='1': must be a finite",
        ),
        ([{"kind": "clamp", "min": 1, "max": 0}], r"clamp needs min < max"),
        ([{"kind": "normalize_by_length", "max_len": 0}], r"data.reward_processor\[0\].max_len=0: must be > 0"),
    ],
)
def test_bad_steps_name_the_entry(spec, message):
    with pytest.raises(ConfigError, match=message):
        RewardProcessor.parse(spec)


def test_data_module_refuses_a_bad_range_and_reads_the_functions_range():
    with pytest.raises(ConfigError, match=r"data.reward_range=\[1.0, 0.0\]: give \[min, max\]"):
        slogan_data(reward_range=[1.0, 0.0])
    data = slogan_data(reward_processor=[{"kind": "scale", "factor": 4}, {"kind": "shift", "offset": -2}])
    assert data.reward_range == (0.0, 1.0)  # the slogan reward's own ``reward_range`` attribute
    assert slogan_data(reward_range=[0, 9]).reward_range == (0.0, 9.0)  # the config wins


def test_tree_returns_use_the_processed_reward_and_logs_the_task_reward(tiny_agents):
    from lit_marl.envs.processors import RewardProcessor

    def reward(agent_completions, tasks):
        return [0.25 * (j % 4) for j in range(len(tasks))]

    tasks = [{"topic": "tea"}, {"topic": "winter"}]
    prompts = [[p.format(topic=t["topic"], word0="a", word1="b") for p in SLOGAN_PROMPTS] for t in tasks]
    processor = RewardProcessor.parse([{"kind": "scale", "factor": 10}, {"kind": "shift", "offset": 1}])
    torch.manual_seed(0)
    batch = tree_from_functions(
        tiny_agents,
        tasks,
        prompts,
        reward,
        num_generations=4,
        sampling=Sampling(max_new_tokens=4),
        reward_processor=processor,
    )
    task_rewards = torch.tensor([0.0, 0.25, 0.5, 0.75] * 2)
    assert torch.allclose(batch.rewards, task_rewards)  # logged: the task reward
    for samples in batch.agents:  # single turn, aligned: a response's return is its joint action's processed reward
        assert torch.allclose(samples.returns, 10 * task_rewards + 1)
        assert torch.allclose(samples.rewards, 10 * task_rewards + 1)
