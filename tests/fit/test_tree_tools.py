"""Tools in a joint rollout tree (``data.tools``): within its turn an agent calls tools, reads the
results in its own format and answers; every reply of the turn is trained, the results are not; the
answer is what the joint reward reads; ``share: team`` shows the turn's calls to the whole team next
turn; a MAGRPO fit with tools moves the policies."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import QWEN25_TOOLS, REPO_ROOT, fit_moves, tree_from_functions
from lit_marl import ConfigError
from lit_marl.agents import Agent, give_tools
from lit_marl.envs.tool_task import calculator
from lit_marl.generation.base import Generation, left_pad
from lit_marl.models import load_model_and_tokenizer
from lit_marl.rollout.transitions import plain
from lit_marl.rollout.tree_tools import TreeTools

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
TOOLS = TreeTools(functions=["lit_marl.envs.tool_task:calculator"], max_rounds=2)


class TeamScript:
    """Replies by agent and call: ``script[i]`` is agent i's replies, consumed in order, one per prompt."""

    name = "scripted"

    def __init__(self, agents, script: list[list[str]]):
        self.agents, self.script, self.prompts = agents, [list(s) for s in script], [[] for _ in agents]
        self.calls: list[int] = []  # how many calls each generate_team held

    def generate_team(self, calls, sampling, seeds=None):
        self.calls.append(len(calls))
        out = []
        for agent, prompts, n in calls:
            i = next(k for k, a in enumerate(self.agents) if a is agent)
            self.prompts[i] += prompts
            replies = [agent.tokenizer.encode(self.script[i].pop(0), add_special_tokens=False) + [agent.eos_token_id]
                       for _ in prompts for _ in range(n)]  # fmt: skip
            prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], agent.pad_token_id, "cpu")
            ids = torch.full((len(replies), max(map(len, replies))), agent.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, reply in enumerate(replies):
                ids[row, : len(reply)], mask[row, : len(reply)] = torch.tensor(reply), 1
            out.append(Generation(prompt_ids, prompt_mask, ids, mask, n))
        return out


@pytest.fixture(scope="module")
def base():
    return load_model_and_tokenizer("tiny-random")


def _agents(base, template):
    model, tokenizer = base
    agents = []
    for _ in range(2):
        tok = copy.deepcopy(tokenizer)
        if template is not None:
            tok.chat_template = template
        agents.append(Agent("tiny-random", loaded=(model, tok)))
    return agents


SEEN = []


def five_reward(agent_completions, tasks):
    SEEN.append([[(a, [c["result"] for c in a.calls]) for a in answers] for answers in agent_completions])
    return [float(a == "5") for a in agent_completions[0]]


@pytest.mark.parametrize("template", [QWEN25_TOOLS, None], ids=["template-tools", "system-fallback"])
def test_a_turn_with_a_tool_round_trains_both_replies_and_rewards_the_answer(base, template):
    agents = _agents(base, template)
    # agent 0: response 0 calls the calculator, then answers; response 1 answers at once; agent 1 answers
    engine = TeamScript(agents, [[CALL, "7", "5"], ["ok", "ok"]])
    SEEN.clear()
    batch = tree_from_functions(
        agents, [{"q": "2+3?"}], [["What is 2 + 3?", "Say ok."]], five_reward, num_generations=2, engine=engine,
        tools=TOOLS, sampling={"max_new_tokens": 64},
    )  # fmt: skip
    # the reward reads the answers as text, and the calls that led to them (``Answer.calls``)
    assert SEEN == [[[("5", ["5"]), ("7", [])], [("ok", []), ("ok", [])]]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    rows = batch.agents[0]
    tok, eos = agents[0].tokenizer, agents[0].eos_token_id
    C = rows.num_completion
    completion = rows.input_ids[0, -C:]
    attention = rows.attention_mask[0, -C:].bool()
    trained = completion[rows.completion_mask[0].bool()].tolist()
    call_ids, answer_ids = tok.encode(CALL, add_special_tokens=False) + [eos], tok.encode("5", add_special_tokens=False)
    assert trained == call_ids + answer_ids + [eos]  # both replies, each with its end-of-turn token
    env_tokens = completion[attention & ~rows.completion_mask[0].bool()].tolist()
    assert env_tokens == agents[0].chat_continuation(_results("5"))  # the result: attended to, never trained
    # the second reply was generated from the prompt, the call and the result, as the row holds them
    prompt = rows.input_ids[0, :-C][rows.attention_mask[0, :-C].bool()].tolist()
    assert engine.prompts[0][-1] == prompt + call_ids + env_tokens
    assert "5" in tok.decode(env_tokens) and ("<tool_response>" in tok.decode(env_tokens))
    assert rows.completion_mask[1].sum() == len(tok.encode("7", add_special_tokens=False)) + 1
    assert batch.stats["train/tool_calls"] == 1.0 and batch.stats["train/tool_malformed"] == 0.0
    assert batch.stats["train/truncated_frac"] == 0.0 and batch.stats["perf/tool_s"] >= 0.0


def test_a_parameter_shared_team_takes_each_tool_round_in_one_call(base):
    """Two roles of one model: the first generation and every tool round are one call over both."""
    (agent,) = _agents(base, None)[:1]
    engine = TeamScript([agent], [[CALL, CALL, "5", "6"]])
    SEEN.clear()
    batch = tree_from_functions(
        [agent, agent], [{"q": "2+3?"}], [["What is 2 + 3?", "And again?"]], five_reward, engine=engine,
        tools=TOOLS, sampling={"max_new_tokens": 64},
    )  # fmt: skip
    assert engine.calls == [1, 1] and len(engine.prompts[0]) == 4  # 2 first prompts, then 2 continuations
    assert [[a for a, _ in answers] for answers in SEEN[0]] == [["5"], ["6"]]
    assert batch.stats["train/tool_calls"] == 2.0


def _results(text):
    from lit_marl.tools import ToolCall, ToolResult, ToolResults

    return ToolResults((ToolResult(ToolCall("calculator", {"expression": "2 + 3"}), text),))


def test_share_team_shows_the_turns_calls_to_every_agent_next_turn(base):
    agents = _agents(base, None)
    team = TreeTools(functions=TOOLS.functions, share="team")
    engine = TeamScript(agents, [[CALL, "5", "again"], ["ok", "ok"]])
    tree_from_functions(
        agents, [{"q": "2+3?"}], [["What is 2 + 3?", "Say ok."]], five_reward, transition=plain, num_turns=2,
        engine=engine, tools=team, sampling={"max_new_tokens": 64},
    )  # fmt: skip
    seen = [agents[i].tokenizer.decode(engine.prompts[i][-1]) for i in range(2)]
    assert all('agent 0: calculator({"expression": "2 + 3"}) -> 5' in text for text in seen)
    engine = TeamScript(agents, [[CALL, "5", "again"], ["ok", "ok"]])
    tree_from_functions(
        agents, [{"q": "2+3?"}], [["What is 2 + 3?", "Say ok."]], five_reward, transition=plain, num_turns=2,
        engine=engine, tools=TOOLS, sampling={"max_new_tokens": 64},
    )  # fmt: skip
    assert "calculator(" not in agents[1].tokenizer.decode(engine.prompts[1][-1])  # caller only: not the team


def test_a_magrpo_fit_with_tools_moves_both_policies(tmp_path, in_repo_root):
    metrics, moved = fit_moves(
        "configs/magrpo/slogan_tiny.yaml",
        *("--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"),
        *("--data.tools", '{"functions": ["lit_marl.envs.tool_task:calculator"], "max_rounds": 1}'),
    )
    assert {n.split(".")[1] for n in moved} == {"0", "1"} and torch.isfinite(metrics["train/loss"])


def test_tools_in_a_tree_are_refused_where_they_cannot_render():
    from lit_marl.data import RolloutDataModule

    slogans = str(REPO_ROOT / "data" / "slogan" / "train.jsonl")
    with pytest.raises(ConfigError, match=r"data.tools needs data.chat_template: true"):
        RolloutDataModule(
            reward_fn="helpers:constant_reward",
            agent_prompts=["{topic}", "{topic}"],
            chat_template=False,
            tools={"functions": TOOLS.functions},
            train_path=slogans,
        )
    with pytest.raises(ConfigError, match=r"data.sampling_streams=per_task with data.tools"):
        RolloutDataModule(
            reward_fn="helpers:constant_reward",
            agent_prompts=["{topic}", "{topic}"],
            sampling_streams="per_task",
            tools={"functions": TOOLS.functions},
            train_path=slogans,
        )
    with pytest.raises(ConfigError, match=r"agent 0 \(object\) cannot call tools"):  # a writer through an API
        give_tools([object()], TOOLS.tools)
    with pytest.raises(ConfigError, match=r"data.tools.functions is empty"):
        TreeTools()
    with pytest.raises(ConfigError, match=r"data.tools.share"):
        TreeTools(functions=TOOLS.functions, share="all")
    # a checkpoint keeps each function by its path, never the function itself
    assert TreeTools(functions=[calculator]).saved()["functions"] == ["lit_marl.envs.tool_task:calculator"]
