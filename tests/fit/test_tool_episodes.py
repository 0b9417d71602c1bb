"""Agents calling tools in their model's own format through whole episodes: the prompt is the
template's rendering with tools=, each tool result comes back as tool messages (environment tokens,
mask 0), only the agent's tokens are trained, and a GRPO fit with tools runs from the CLI and from
Python."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import QWEN25_TOOLS, REPO_ROOT, ScriptedEngine, fit_moves
from lit_marl.agents import Agent
from lit_marl.envs import make_env
from lit_marl.envs.game import StepResult
from lit_marl.envs.tool_task import ToolTask, calculator, number_answer
from lit_marl.generation import Sampling
from lit_marl.models import load_model_and_tokenizer
from lit_marl.rollout.episode import EpisodeSettings, run_episodes
from lit_marl.tools import ToolCall, ToolResult, ToolResults, load_tools
from lit_marl.tools.formats import format_calls

TASK = {"prompt": "What is 37 * 91?", "answer": 3367}
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
REPLIES = [CALL.format("37 * 91"), CALL.format("3367 + 0") + "\n" + CALL.format("1 / 0"), "{broken", "3367"]


@pytest.fixture(scope="module")
def base():
    return load_model_and_tokenizer("tiny-random")


def _agent(base, template: str | None) -> Agent:
    model, tokenizer = base
    tokenizer = copy.deepcopy(tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    return Agent("tiny-random", loaded=(model, tokenizer))


def _env():
    return make_env(
        "tools",
        {"tools": ["lit_marl.envs.tool_task:calculator"], "reward": "lit_marl.envs.tool_task:number_answer"},
    )


@pytest.mark.parametrize("template", [QWEN25_TOOLS, None], ids=["template-tools", "system-fallback"])
def test_the_agent_trains_on_its_own_tokens_across_three_tool_turns(base, template):
    agent, env = _agent(base, template), _env()
    replies = [REPLIES[0], REPLIES[1], "<tool_call>\n{broken\n</tool_call>", "The answer is 3367."]
    settings = EpisodeSettings(max_turns=4, sampling=Sampling(max_new_tokens=64))
    (batch,) = run_episodes([agent], [TASK], env, settings, engine=ScriptedEngine([[r] for r in replies]))
    ids, mask = batch.input_ids[0][batch.attention_mask[0].bool()].tolist(), batch.loss_mask[0]
    mask = mask[batch.attention_mask[0].bool()].tolist()
    tokenizer = agent.tokenizer
    # the prompt is the template's own rendering with the tools (or the documented system message)
    (tool,) = load_tools([calculator])
    prompt = agent.encode_prompt(TASK["prompt"])
    if template is not None:
        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": TASK["prompt"]}], tools=[tool.schema], add_generation_prompt=True
        )
        assert prompt == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    else:
        assert "<tools>\n" + json.dumps(tool.schema) in tokenizer.decode(prompt)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    # exactly the replies' tokens (each with its end-of-turn token) carry the loss
    trained = [tok for tok, m in zip(ids, mask) if m]
    expected_replies = [tokenizer.encode(r, add_special_tokens=False) + [agent.eos_token_id] for r in replies]
    assert trained == [tok for reply in expected_replies for tok in reply]
    runs, start = [], None
    for k, m in enumerate(mask + [0]):
        if m and start is None:
            start = k
        if not m and start is not None:
            runs.append(ids[start:k])
            start = None
    assert runs == expected_replies  # four replies, each one run of mask 1 between environment tokens
    text = tokenizer.decode(ids)
    assert "3367" in text and "error: calculator: ZeroDivisionError: division by zero" in text
    assert "error: tool call 1: not JSON" in text  # the malformed call is an observation the agent reads
    if template is not None:
        assert text.count("<tool_response>") == 4 and text.count("<|im_start|>user\n<tool_response>") == 3
    assert float(batch.rewards.sum()) == 1.0 and bool(batch.won[0])
    info_counts = batch.stats
    assert info_counts["env/calls"] == 3.0 and info_counts["env/malformed"] == 1.0
    assert info_counts["env/tool_errors"] == 1.0


def test_a_grpo_fit_with_tools_moves_the_policy(tmp_path, in_repo_root):
    metrics, moved = fit_moves(
        "configs/grpo/tools_tiny.yaml",
        *("--trainer.limit_val_batches", "0", "--data.env_kwargs.reward", "helpers:answer_length"),
        *("--data.reward_density", "dense"),  # the answer's score, not only a win: the episodes differ
    )
    assert moved and torch.isfinite(metrics["train/loss"]) and "env/calls" in metrics


def test_tools_as_python_functions_through_the_python_api(tmp_path):
    """The same fit from Python: the tools handed over as functions, the reward as a function too."""
    import lightning as L

    from helpers import answer_length, make_trainer
    from lit_marl.algorithms import GRPO
    from lit_marl.data import EpisodeDataModule

    L.seed_everything(0)
    module = GRPO(model="tiny-random", learning_rate=1e-3)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = EpisodeDataModule(
        env="tools",
        env_kwargs={"tools": [calculator], "reward": answer_length},
        train_path=str(REPO_ROOT / "data" / "tools" / "train.jsonl"),
        tasks_per_step=2,
        num_generations=4,
        max_turns=3,
        sampling={"max_new_tokens": 16},
        reward_density="dense",
    )
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0).fit(module, datamodule=data)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())


@pytest.mark.parametrize("template", [QWEN25_TOOLS, None], ids=["template-tools", "system-fallback"])
def test_a_tool_demonstration_renders_as_the_episode_it_shows(base, template):
    """The expert's chat (its call, the result as a tool message, its answer) renders to the very
    tokens and loss mask an episode with the same replies has: SFT trains what RL will play."""
    from lit_marl.rollout.demos import agent_chats, render_chat

    agent, env = _agent(base, template), _env()
    row = json.loads((REPO_ROOT / "data" / "tools" / "demo_tasks.jsonl").read_text().splitlines()[0])
    (chat,) = agent_chats({"messages": env.demonstration(row)}, 1, "demo 0")
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant"]
    agent.use_tools(list(env.tools))
    ids, mask = render_chat(agent, chat)
    replies = [[chat[1]["content"]], [chat[3]["content"]]]
    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=64))
    (batch,) = run_episodes([agent], [row], env, settings, engine=ScriptedEngine(replies))
    keep = batch.attention_mask[0].bool()
    assert ids == batch.input_ids[0][keep].tolist() and mask == batch.loss_mask[0][keep].tolist()
    assert bool(batch.won[0])


def test_trees_refuse_an_environment_with_tools():
    from lit_marl import ConfigError
    from lit_marl.data import RolloutDataModule

    with pytest.raises(
        ConfigError,
        match=r"data.env offers tools \(calculator\): a game.s tool calls are played in episodes .* data.tools",
    ):
        RolloutDataModule(
            env="tools",
            env_kwargs={"tools": [calculator], "reward": "lit_marl.envs.tool_task:number_answer"},
            train_path=str(REPO_ROOT / "data" / "tools" / "train.jsonl"),
        )


@pytest.mark.parametrize("template", [QWEN25_TOOLS, None], ids=["template-tools", "system-fallback"])
def test_a_textworld_walkthrough_as_tool_calls_wins_and_renders_as_its_demonstration(base, template, tmp_path):
    """TextWorld in tools mode: the walkthrough's commands as tool calls win the game through the
    rollout, only the calls' tokens are trained, and the demonstration of the same game renders to the
    episode's very tokens and mask."""
    from lit_marl.envs.textworld.games import write_tasks
    from lit_marl.rollout.demos import agent_chats, render_chat

    agent, env = _agent(base, template), make_env("textworld", {"tool_mode": "tools"})
    row = json.loads(write_tasks("w1-o1-q2", "train", 1, tmp_path).read_text().splitlines()[0])
    (chat,) = agent_chats({"messages": env.demonstration(row)}, 1, "demo 0")
    calls = [m["content"] for m in chat if m["role"] == "assistant"]
    assert all(c.startswith("<tool_call>\n{") for c in calls)
    agent.use_tools(list(env.tools))
    ids, mask = render_chat(agent, chat)
    settings = EpisodeSettings(max_turns=len(calls) + 1, sampling=Sampling(max_new_tokens=64), max_context_tokens=8192)
    (batch,) = run_episodes([agent], [row], env, settings, engine=ScriptedEngine([[c] for c in calls]))
    keep = batch.attention_mask[0].bool()
    assert ids == batch.input_ids[0][keep].tolist() and mask == batch.loss_mask[0][keep].tolist()
    trained = [tok for tok, m in zip(ids, mask) if m]
    tokenizer = agent.tokenizer
    assert trained == [t for c in calls for t in tokenizer.encode(c, add_special_tokens=False) + [agent.eos_token_id]]
    assert bool(batch.won[0]) and batch.stats["env/calls"] == len(calls) and batch.stats["env/tool_errors"] == 0


class ToolTurns(ToolTask):
    """Every reply gets a tool result back (what it called, or that it called nothing), so each
    episode runs its turns through tool messages whatever the untrained model writes."""

    def act(self, actions):
        reply = actions[0]
        text = f"{len(reply.calls)} call(s), {len(reply.errors)} malformed; you wrote: {reply.content[:40]}"
        return StepResult([ToolResults((ToolResult(ToolCall("calculator", {}), text),))], info=self._info(0.0, False))


@pytest.mark.parametrize("template", [QWEN25_TOOLS, None], ids=["template-tools", "system-fallback"])
def test_a_tool_trajectory_through_hf_generate_equals_the_lean_decoders(base, template):
    """Greedy, three turns whose observations are tool results: transformers' generate and the lean
    decoder give the same token ids and loss masks (vLLM's: tests/vllm/test_tool_trajectories.py)."""
    from lit_marl.generation import make_engine

    agent = _agent(base, template)
    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=12, greedy=True))

    tasks = [TASK, {**TASK, "prompt": "What is 12 * 64?"}]

    def trajectories(engine):
        (batch,) = run_episodes([agent], tasks, ToolTurns([calculator], number_answer), settings, engine=engine)
        keep = batch.attention_mask.bool()
        return [(ids[k].tolist(), mask[k].tolist()) for ids, mask, k in zip(batch.input_ids, batch.loss_mask, keep)]

    lean = trajectories(make_engine("torch"))
    assert trajectories(make_engine("hf")) == lean
    for _, mask in lean:  # three replies, each its own run of trained tokens between tool messages
        assert sum(1 for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])) == 3


def test_a_game_episode_whose_first_reply_plays_nothing_goes_on(base):
    """Corridor in tools mode: a first reply without a call (the untrained model's usual reply) is an
    error the agent reads; the game's outcome as it stands is the turn's, and the next calls play."""
    agent, env = _agent(base, None), make_env("corridor", {"tool_mode": "tools"})
    replies = ["I walk east.", format_calls([ToolCall("east", {})]), format_calls([ToolCall("take_key", {})])]
    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=64))
    (batch,) = run_episodes(
        [agent], [{"length": 3, "key_room": 1}], env, settings, engine=ScriptedEngine([[r] for r in replies])
    )
    assert batch.scores[0].tolist() == [0.0, 0.0, 1.0] and float(batch.max_score[0]) == 3.0
    assert batch.stats["env/tool_errors"] == 1.0 and batch.stats["env/calls"] == 2.0
    assert "error: no tool call: act by calling one of east" in agent.tokenizer.decode(batch.input_ids[0])
