"""The code env's next-turn prompts: plain's own-history layout (CoMLRL's self-improvement mode) and
expert edits split per role, with the expert's structured reply parsed, re-asked when malformed and
replaced by a fallback when it stays so. No model is loaded: the experts here are scripted."""

from __future__ import annotations

import json

import pytest

from lit_marl import ConfigError
from lit_marl.envs.code import CodeEnv, Expert
from lit_marl.envs.code.env import REVISE
from lit_marl.envs.code.expert import parse_edits

ADD = {
    "task_id": "T/add",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
}
# three turns of a helper + main team: each agent's prompts and replies, distinct per turn
PROMPTS = [[f"AUX PROMPT {t}" for t in (1, 2, 3)], [f"MAIN PROMPT {t}" for t in (1, 2, 3)]]
REPLIES = [
    [f"```python\ndef aux(a, b):\n    return a + b + {t}\n```" for t in (1, 2, 3)],
    [f"def add(a, b):\n    return aux(a, b) - {t}" for t in (1, 2, 3)],
]


def _transition(env, replies=REPLIES, prompts=PROMPTS):
    return env.transition(
        task=[ADD],
        prompt=[ADD["prompt"]],
        agent_completions=[[r[-1] for r in replies]],
        num_agents=len(replies),
        prompt_history_per_agent=[prompts],
        response_history_per_agent=[replies],
    )[0]


# --------------------------------------------------------------------------- plain
def test_plain_shows_the_agents_own_turns_in_order_and_no_teammate():
    aux_prompt, main_prompt = _transition(CodeEnv(roles="aux_main", transition="plain"))
    for agent, prompt in enumerate((aux_prompt, main_prompt)):
        own = [
            f"Your prompt at turn {t}:\n{PROMPTS[agent][t - 1]}" if kind == "prompt" else f"Your code at turn {t}:"
            for t in (1, 2, 3)
            for kind in ("prompt", "code")
        ]
        at = [prompt.index(part) for part in own]
        assert at == sorted(at), prompt  # prompt 1, code 1, prompt 2, code 2, prompt 3, code 3
        assert prompt.endswith(REVISE) and "Feedback" not in prompt and "teammate" not in prompt
        other = 1 - agent
        assert not any(p in prompt for p in PROMPTS[other])
    for t in (1, 2, 3):
        assert f"return a + b + {t}" in aux_prompt and f"return a + b + {t}" not in main_prompt
        assert f"return aux(a, b) - {t}" in main_prompt and f"return aux(a, b) - {t}" not in aux_prompt
    assert aux_prompt.startswith("Your prompt at turn 1:\nAUX PROMPT 1")  # the first prompt once, as turn 1's


def test_explicit_settings_bring_back_the_last_turn_with_teammates_layout():
    env = CodeEnv(roles="aux_main", transition="plain", history="last", show_teammates=True)
    aux_prompt, main_prompt = _transition(env)
    assert main_prompt.startswith("MAIN PROMPT 1\n\nYour code at turn 3:")  # the first prompt, then the last code
    assert "Your code at turn 1:" not in main_prompt and "Your prompt at turn" not in main_prompt
    assert "MAIN PROMPT 2" not in main_prompt
    assert "Your teammate's `aux`:\n```python\ndef aux(a, b):\n    return a + b + 3\n```" in main_prompt
    assert "Your teammate's `add`" in aux_prompt and main_prompt.endswith(REVISE)
    # the other modes keep their defaults: the last turn's code and the teammates'
    feedback = CodeEnv(roles="aux_main", transition="level_feedback")
    assert (feedback.history, feedback.show_teammates) == ("last", True)
    # and take the plain layout when asked
    turns = CodeEnv(roles="aux_main", transition="level_feedback", history="turns", show_teammates=False)
    _, main_prompt = _transition(turns)
    assert "Your prompt at turn 2:\nMAIN PROMPT 2" in main_prompt and "Feedback on the team's program:" in main_prompt
    assert "teammate" not in main_prompt


def test_turns_history_keeps_the_original_prompt():
    with pytest.raises(ConfigError, match=r"include_original_prompt=false .*history=turns \(plain's default\).*last"):
        CodeEnv(transition="plain", include_original_prompt=False)
    env = CodeEnv(transition="plain", include_original_prompt=False, history="all")  # today's plain, without it
    (prompt,) = _transition(env, replies=REPLIES[1:], prompts=PROMPTS[1:])
    assert prompt.startswith("Your code at turn 1:") and "MAIN PROMPT" not in prompt


# --------------------------------------------------------------------------- parsing the expert's reply
def test_parse_edits_finds_the_object_that_names_the_functions():
    names = ["aux", "add"]
    fenced = 'Sure.\n```json\n{"aux": "Return a tuple.", "add": "Call aux."}\n```'
    assert parse_edits(fenced, names) == ({"aux": "Return a tuple.", "add": "Call aux."}, "")
    # code with braces, raw newlines inside strings, keys written as code, lists of edits, a wrapper object
    messy = (
        'Think: a dict like {"k": 1} is not it.\n{"edits": {"`aux`": "def aux(a, b):\n    return {a: b}", '
        '"ADD()": ["Use aux.", "Return its result."]}}'
    )
    edits, problem = parse_edits(messy, names)
    assert problem == "" and edits == {
        "aux": "def aux(a, b):\n    return {a: b}",
        "add": "Use aux.\nReturn its result.",
    }
    # the last of two complete objects wins (a model may draft first)
    two = '{"aux": "draft", "add": "draft"} then {"aux": "final", "add": "final"}'
    assert parse_edits(two, names)[0] == {"aux": "final", "add": "final"}
    assert parse_edits('{"aux": "only aux"}', names) == ({"aux": "only aux"}, 'its JSON object has no string for "add"')
    assert parse_edits('{"aux": 3, "add": "x"}', names)[1] == 'its JSON object has no string for "aux"'
    assert parse_edits("Fix the loop.", names) == ({}, 'it holds no JSON object with a string for "aux", "add"')
    assert parse_edits('{"aux": "cut short by the tok', names)[1].startswith("it holds no JSON object")


# --------------------------------------------------------------------------- per-role edits
class ScriptedExpert(Expert):
    """Replies from a script, one list per ask; records what it was asked and whether it sampled."""

    def __init__(self, script: list[list[str]], **kwargs):
        super().__init__(model="scripted", **kwargs)
        self.script = list(script)
        self.asked: list[tuple[list[str], bool]] = []

    def _ask(self, messages, sample):
        self.asked.append((messages, sample))
        replies = self.script.pop(0)
        assert len(replies) == len(messages)
        return replies


GOOD = json.dumps({"aux": "Return a + b.", "add": "Return aux(a, b)."})


def test_each_agent_gets_the_edits_to_its_own_function():
    expert = ScriptedExpert([[GOOD]])
    env = CodeEnv(roles="aux_main", transition="expert_edits", expert=expert)
    aux_prompt, main_prompt = _transition(env)
    assert "proposes these edits to your `aux`:\nReturn a + b." in aux_prompt and "Return aux(a, b)." not in aux_prompt
    assert (
        "proposes these edits to your `add`:\nReturn aux(a, b)." in main_prompt and "Return a + b." not in main_prompt
    )
    ((message,), sample), *_ = expert.asked
    assert not sample and "- `aux`: agent 1 (helper), a helper" in message and "- `add`: agent 2 (main)" in message
    assert '{"aux": "<edits to aux>", "add": "<edits to add>"}' in message and "return aux(a, b) - 3" in message
    assert main_prompt.endswith(REVISE) and "Your code at turn 3:" in main_prompt  # expert_edits keeps "last"
    assert (expert.format_retries, expert.malformed_replies) == (0, 0)


def test_a_malformed_reply_is_asked_again_sampled_with_a_note():
    expert = ScriptedExpert([[GOOD, "no json here"], ['{"aux": "Keep it."}'], [GOOD]], retries=2)
    edits = expert.propose(["t1", "t2"], ["p1", "p2"], [{"aux": "h", "add": "m"}] * 2)
    assert edits == [{"aux": "Return a + b.", "add": "Return aux(a, b)."}] * 2
    (first, greedy), (second, sampled), (third, _) = expert.asked
    assert not greedy and sampled and len(second) == len(third) == 1  # only the malformed branch is asked again
    assert second[0].startswith(first[1]) and "could not be used: it holds no JSON object" in second[0]
    assert 'its JSON object has no string for "add"' in third[0]  # the incomplete reply is asked again too
    assert (expert.format_retries, expert.malformed_replies) == (2, 0)


@pytest.mark.parametrize("fallback", ["raw", "none"])
def test_a_reply_malformed_to_the_end_gives_the_fallback_and_is_counted(fallback):
    expert = ScriptedExpert(
        [['Use aux. {"aux": "Keep it."}'], ["Just call aux from add."]], retries=1, fallback=fallback
    )
    env = CodeEnv(roles="aux_main", transition="expert_edits", expert=expert)
    aux_prompt, main_prompt = _transition(env)
    assert (expert.format_retries, expert.malformed_replies) == (1, 1)
    # what the tree logs per turn (turn_{t}/expert_malformed_frac): one branch, malformed to the end
    assert env.transition_metrics() == {"expert_malformed_frac": 1.0, "expert_format_retries": 1.0}
    if fallback == "raw":  # the last reply, whole, to both roles
        for prompt in (aux_prompt, main_prompt):
            assert "did not follow the per-function format; here it is in full.)\nJust call aux from add." in prompt
    else:
        assert "proposes these edits to your `aux`:\nThe expert proposes no edits to `aux`." in aux_prompt
        assert "The expert proposes no edits to `add`." in main_prompt and "Just call" not in main_prompt
    # a role the last reply did cover keeps its part; an empty part means no changes
    partial = ScriptedExpert([['{"aux": "", "add": "Return 0."}', '{"add": "Return 1."}']], retries=0)
    assert partial.propose(["t", "t"], ["p", "p"], [{"aux": "h", "add": "m"}] * 2)[0] == {
        "aux": "No changes needed.",
        "add": "Return 0.",
    }
    (edits,) = ScriptedExpert([['{"add": "Return 1."}']], retries=0, fallback="none").propose(
        ["t"], ["p"], [{"aux": "h", "add": "m"}]
    )
    assert edits == {"aux": "The expert proposes no edits to `aux`.", "add": "Return 1."}


def test_expert_settings_fail_clearly():
    with pytest.raises(ConfigError, match=r"data\.env\.expert\.prompt: the template must contain \{format\}"):
        Expert(model="m", prompt="Review {code} for {prompt}.")
    with pytest.raises(ConfigError, match=r"data\.env\.expert\.prompt: unknown fields \['task'\]"):
        Expert(model="m", prompt="{task} {format}")
    with pytest.raises(ConfigError, match=r"data\.env\.expert\.retries=-1: must be >= 0"):
        Expert(model="m", retries=-1)
    with pytest.raises(ConfigError, match=r"data\.env\.expert\.fallback='all': choose raw, none"):
        Expert(model="m", fallback="all")
