"""Multi-turn token-in/token-out under chat templates of the Qwen family, built here from template
strings written in their style (no download): Qwen2.5's (a default system message; a dialogue renders
as an extension of its prefix) and Qwen3's (the latest reply gets a think block, earlier replies lose
theirs: rendering a longer dialogue rewrites the shorter one). Either way every turn must be trained on
exactly the tokens it was generated from."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from helpers import RecordingEngine, ScriptedEngine
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.envs import make_env
from lit_marl.generation import Sampling
from lit_marl.models import load_model_and_tokenizer
from lit_marl.rollout.episode import EpisodeSettings, action_text, run_episodes

QWEN25_STYLE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

REPLIES = ["<think>\nthe key first\n</think>\n\nsearch", "<think>\nstill no key\n</think>\n\nwait", "fly"]


@pytest.fixture(scope="module")
def base():
    return load_model_and_tokenizer("tiny-random")


def _agent(base, template: str | None, system_prompt: str | None = None) -> Agent:
    model, tokenizer = base
    tokenizer = copy.deepcopy(tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    return Agent("tiny-random", system_prompt=system_prompt, loaded=(model, tokenizer))


def _dialogue(observations: list[str], replies: list[str]) -> list[dict]:
    messages = []
    for observation, reply in zip(observations, replies):
        messages += [{"role": "user", "content": observation}, {"role": "assistant", "content": reply}]
    return messages


@pytest.mark.parametrize("system_prompt", [None, "Play well."])
def test_the_continuation_is_the_segment_after_a_past_reply(base, system_prompt):
    for template in (None, QWEN25_STYLE, QWEN3_STYLE):
        agent = _agent(base, template, system_prompt)
        closed = agent.tokenizer.decode(agent.chat_continuation("You see a door.", closed=True))
        assert closed == "\n<|im_start|>user\nYou see a door.<|im_end|>\n<|im_start|>assistant\n"
        cut = agent.tokenizer.decode(agent.chat_continuation("You see a door.", closed=False))
        assert cut == "<|im_end|>" + closed  # a reply cut by the budget is closed first
    assert not _agent(base, QWEN25_STYLE).rewrites_history and not _agent(base, None).rewrites_history
    assert _agent(base, QWEN3_STYLE).rewrites_history


def test_a_template_that_drops_past_replies_is_refused(base):
    forgetful = QWEN25_STYLE.replace(
        "m.content + '<|im_end|>", "(m.content if m.role != 'assistant' else '') + '<|im_end|>"
    )
    with pytest.raises(ValueError, match="does not render a past reply"):
        _agent(base, forgetful).chat_continuation("hello")


@pytest.mark.parametrize("template", [QWEN25_STYLE, QWEN3_STYLE], ids=["qwen2.5-style", "qwen3-style"])
def test_each_turn_trains_on_exactly_the_tokens_it_was_generated_from(base, template):
    agent = _agent(base, template)
    engine = RecordingEngine(ScriptedEngine([[reply] for reply in REPLIES]))
    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=64))
    env = make_env("corridor", {"instructions": False})
    if agent.rewrites_history:
        with pytest.warns(UserWarning, match="rewrites earlier turns"):
            (batch,) = run_episodes([agent], [{"length": 6, "key_room": 4}], env, settings, engine=engine)
    else:
        (batch,) = run_episodes([agent], [{"length": 6, "key_room": 4}], env, settings, engine=engine)
    assert int(batch.num_turns[0]) == 3
    ids = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    loss_mask = batch.loss_mask[0][batch.attention_mask[0].bool()].tolist()
    trained = []
    for turn, (_, prompts, out) in enumerate(engine.calls):
        seen, produced = prompts[0], out.completion_ids[0][out.completion_mask[0].bool()].tolist()
        assert ids[: len(seen)] == seen, f"turn {turn}: its context is not a prefix of the training row"
        assert ids[len(seen) : len(seen) + len(produced)] == produced
        assert agent.tokenizer.decode(produced[:-1]) == REPLIES[turn]  # the think block stays, as generated
        trained += list(range(len(seen), len(seen) + len(produced)))
    assert [i for i, m in enumerate(loss_mask) if m] == trained  # the loss covers the replies only
    observations = [agent.tokenizer.decode(p[0]) for _, p, _ in engine.calls]
    assert all(o.endswith("<|im_start|>assistant\n") for o in observations)
    # the template's own rendering of the same dialogue: equal for Qwen2.5's, rewritten by Qwen3's
    said = [batch_text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0] for batch_text in observations]
    rendered = agent.tokenizer.apply_chat_template(_dialogue(said, REPLIES), tokenize=False)
    ours = agent.tokenizer.decode(ids)
    assert (rendered == ours + "\n") != agent.rewrites_history
    if agent.rewrites_history:
        assert "still no key" not in rendered.split("fly")[0] and "still no key" in ours


def test_sft_demonstrations_render_as_episodes_do(base):
    """A demonstration under the Qwen3-style template: the same tokens an episode with those replies
    holds (one context form for SFT and RL)."""
    from lit_marl.rollout.demos import render_chat

    agent = _agent(base, QWEN3_STYLE)
    chat = _dialogue(["first", "second"], REPLIES[:2])
    ids, mask = render_chat(agent, chat)
    expected = agent.encode_prompt("first")
    for k, reply in enumerate(REPLIES[:2]):
        expected += agent.tokenizer(reply, add_special_tokens=False)["input_ids"] + [agent.eos_token_id]
        if k == 0:
            expected += agent.chat_continuation("second")
    assert ids == expected and sum(mask) == len(ids) - len(agent.encode_prompt("first")) - len(
        agent.chat_continuation("second")
    )
    assert torch.tensor(mask).sum() > 0


@pytest.mark.parametrize(
    "reply, action",
    [
        ("<think>\nnorth is locked\n</think>\n\ngo south", "go south"),
        ("<think>a</think>go east<think>b</think>\n take key", "take key"),  # after the LAST block
        ("<think>\nmaybe go north, then", ""),  # cut while reasoning: no command read out of it
        ("go west", "go west"),  # no reasoning at all
        ("</think>open door", "open door"),
        ("<think>a</think>go<think>b", "go"),  # a new block opened after the action: not part of it
    ],
)
def test_the_env_acts_on_what_follows_the_reasoning(reply, action):
    assert action_text(reply, "think") == action
    assert action_text(reply, "none") == reply


def test_a_template_that_opens_the_reasoning_itself(base):
    """QwQ-style templates end the generation prompt inside ``<think>``: a reply is reasoning until its
    ``</think>``, so a reply cut before it acts with nothing (without the tags' evidence in the reply)."""
    thinking = QWEN3_STYLE.replace(
        "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking",
        "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- if enable_thinking",
    )
    assert thinking != QWEN3_STYLE
    assert _agent(base, thinking).opens_reasoning
    assert not _agent(base, QWEN3_STYLE).opens_reasoning and not _agent(base, None).opens_reasoning
    assert action_text("north is locked, so\n</think>\n\ngo south", "think", opened=True) == "go south"
    assert action_text("north is locked, so go north", "think", opened=True) == ""
    assert action_text("north is locked, so go north", "think", opened=False) == "north is locked, so go north"


def test_episodes_with_reasoning_step_the_env_with_the_action_and_train_on_the_whole_reply(base):
    from lit_marl.envs.corridor import Corridor

    seen = []

    class Recorded(Corridor):
        def act(self, actions):
            seen.append(list(actions))
            return super().act(actions)

    agent = _agent(base, QWEN3_STYLE)
    for reasoning, expected in (("think", [["search"], ["wait"], ["fly"]]), ("none", [[r] for r in REPLIES])):
        seen.clear()
        settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=64), reasoning=reasoning)
        engine = ScriptedEngine([[reply] for reply in REPLIES])
        with pytest.warns(UserWarning, match="rewrites earlier turns"):
            (batch,) = run_episodes([agent], [{"length": 6, "key_room": 4}], Recorded(False), settings, engine=engine)
        assert seen == expected
        assert batch.replies[0] == REPLIES  # the row and the log keep the whole replies
        trained = batch.input_ids[0][batch.loss_mask[0].bool()]
        assert "still no key" in agent.tokenizer.decode(trained)


@pytest.mark.parametrize("template", [QWEN25_STYLE, QWEN3_STYLE], ids=["qwen2.5-style", "qwen3-style"])
def test_strict_history_refuses_a_template_that_rewrites_earlier_turns(base, template):
    """``data.history: strict``: the context must be the template's own rendering; a template that
    rewrites history is refused by name (at the first rollout, before any update), one that extends
    plays as before."""
    agent = _agent(base, template)
    engine = ScriptedEngine([[reply] for reply in REPLIES])
    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=64), history="strict")
    env = make_env("corridor", {"instructions": False})
    if agent.rewrites_history:
        with pytest.raises(
            ConfigError, match=r"data.history=strict: agent 0's chat template .* data.history: verbatim"
        ):
            run_episodes([agent], [{"length": 6, "key_room": 4}], env, settings, engine=engine)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning either: nothing is rewritten
        (batch,) = run_episodes([agent], [{"length": 6, "key_room": 4}], env, settings, engine=engine)
    assert int(batch.num_turns[0]) == 3
