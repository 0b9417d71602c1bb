"""Centralized play (``lit_marl/envs/centralized.py``): the tagged adapter's prompt and parsing, the
joint reward through the roles, parse failures counted and never rewarded, shortcuts that earn nothing."""

from __future__ import annotations

import pytest

from helpers import SLOGAN_PROMPTS
from lit_marl.envs.base import FunctionEnv
from lit_marl.envs.calls import call_reward
from lit_marl.envs.centralized import CentralizedEnv, ParseError, TaggedAdapter
from lit_marl.envs.slogan import reward as slogan_reward

TASK = {"topic": "a chess club", "word0": "fast", "word1": "calm"}
LINE0 = "Our chess club plays fast and wins every single game!"
LINE1 = "Stay calm, think deeply, and enjoy the quiet battle!"


def env(parse_failure_reward=0.0):
    return CentralizedEnv(FunctionEnv(SLOGAN_PROMPTS, slogan_reward), TaggedAdapter(), parse_failure_reward)


def score(texts, **kwargs):
    rewards, metrics, samples = None, None, {}
    rewards, metrics = call_reward(env(**kwargs).reward, [texts], [TASK] * len(texts), samples=samples)
    return rewards.tolist(), samples


def test_prompt_holds_every_roles_prompt_and_asks_for_tagged_sections():
    (prompt,) = env().prompts(TASK)
    assert "producing the separate outputs of 2 agents" in prompt
    for i, p in enumerate(SLOGAN_PROMPTS):
        assert f"Agent {i} original prompt:\n{p.format(**TASK)}" in prompt
    assert prompt.endswith("<agent_0>\n...\n</agent_0>\n<agent_1>\n...\n</agent_1>\n")
    assert env().num_agents == 1


def test_parse_sections_case_spaces_first_match_and_missing_roles():
    adapter = TaggedAdapter()
    text = "intro <AGENT_1 > b </ agent_1> junk <agent_0>\n a \n</agent_0><agent_0>second</agent_0>"
    assert adapter.parse_completion(text, TASK, 2) == ["a", "b"]
    with pytest.raises(ParseError, match="no <agent_0> section"):  # partial: a failure (CoMLRL: roles empty)
        adapter.parse_completion("<agent_1>only</agent_1>", TASK, 2)
    with pytest.raises(ParseError):
        adapter.parse_completion("no tags here <agent_0> unclosed", TASK, 2)


def test_a_correct_joint_answer_earns_full_reward():
    rewards, samples = score([f"<agent_0>{LINE0}</agent_0>\n<agent_1>{LINE1}</agent_1>"])
    assert rewards == [1.0]
    assert samples["success"].tolist() == [1.0] and samples["parse_failed"].tolist() == [0.0]


def test_parse_failures_are_counted_and_earn_the_failure_reward_not_the_roles():
    texts = ["I refuse to use tags.", f"<agent_0>{LINE0}</agent_0><agent_1>{LINE1}</agent_1>"]
    rewards, samples = score(texts)
    assert rewards == [0.0, 1.0]
    assert samples["parse_failed"].tolist() == [1.0, 0.0]
    assert samples["success"].tolist() == [0.0, 1.0]  # a failure passed no check
    rewards, _ = score(texts, parse_failure_reward=-1.0)
    assert rewards == [-1.0, 1.0]
    # CoMLRL's behaviour (null): the roles are scored as empty strings, which the slogan reward
    # gives 1/9 (two empty lines do not overlap); the default never rewards a failure
    rewards, samples = score(texts, parse_failure_reward=None)
    assert rewards == pytest.approx([1 / 9, 1.0]) and samples["parse_failed"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "text",
    [
        f"<agent_0>{LINE0}</agent_0><agent_1>{LINE0.replace('fast', 'calm')}</agent_1>",  # one line twice
        f"<agent_0>{LINE0}</agent_0>",  # one role only: a parse failure
        f"{LINE1} <agent_0>{LINE0}</agent_0><agent_1></agent_1>",  # the line outside the tags does not count
        f"<agent_0>{LINE0}\n{LINE1}</agent_0><agent_1>{LINE1}</agent_1>",  # two lines in one section
    ],
)
def test_shortcuts_do_not_succeed(text):
    rewards, samples = score([text])
    assert rewards[0] < 1.0 and samples["success"].tolist() == [0.0]


def test_a_single_section_earns_nothing():
    """CoMLRL would score the missing role as an empty line: 1/9 from the slogan reward for no answer."""
    rewards, samples = score([f"<agent_1>{LINE1}</agent_1>", "<agent_0></agent_0>"])
    assert rewards == [0.0, 0.0] and samples["parse_failed"].tolist() == [1.0, 1.0]


def test_an_adapter_returning_the_wrong_number_of_roles_is_an_error():
    class Broken(TaggedAdapter):
        def parse_completion(self, completion, task, num_agents):
            return [completion]

    broken = CentralizedEnv(FunctionEnv(SLOGAN_PROMPTS, slogan_reward), Broken())
    with pytest.raises(ValueError, match="must return 2 strings"):
        broken.reward([["x"]], [TASK])
