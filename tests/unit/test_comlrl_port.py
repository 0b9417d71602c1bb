"""A CoMLRL 1.4.3 script ported to lit_marl (``tests/comlrl_port.py``: formatters as functions, the
seed's ``custom_external``, a positional reward): the prompts each agent reads at turns 1 and 2 are
the ones CoMLRL builds, text and token ids (pinned from CoMLRL's own code by
``scripts/comlrl_prompts.py`` in ``tests/fixtures/comlrl_1.4.3_prompts.json``), through the Python
API and through the CLI with the parity preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from comlrl_port import COMPLETIONS, FORMATTERS, TASKS, custom_external, length_reward

from lit_marl import ConfigError
from lit_marl.data import RolloutDataModule

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "comlrl_1.4.3_prompts.json").read_text())


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    return str(path)


def two_turns(env) -> list:
    """Per task, per turn, per agent: the text each agent reads."""
    states = env.reset(TASKS)
    first = [list(s.observations) for s in states]
    env.step(states, COMPLETIONS, turn=0)
    return [[a, list(s.observations)] for a, s in zip(first, states)]


@pytest.mark.parametrize("passthrough", [False, True])
def test_the_python_api_builds_comlrl_s_prompts(task_file, tiny_agents, passthrough):
    data = RolloutDataModule(
        train_path=task_file,
        agent_prompts=FORMATTERS,
        reward_fn=length_reward,
        transition=custom_external,
        num_turns=2,
        external_prompt_passthrough=passthrough,
        chat_template=False,
    )
    assert data.num_agents == 2 and data.tree.chat_template is False
    expected = FIXTURE["passthrough" if passthrough else "formatted"]
    seen = two_turns(data.env)
    assert seen == [[[agent["text"] for agent in turn] for turn in task] for task in expected]
    agent = tiny_agents[0]  # the same tokenizer files CoMLRL tokenized with
    for task, texts in zip(expected, seen):
        for turn, turn_texts in zip(task, texts):
            assert [agent.encode_prompt(text, raw=True) for text in turn_texts] == [a["ids"] for a in turn]


def test_the_formatter_frames_turn_two_unless_passed_through(task_file):
    formatted = FIXTURE["formatted"][0][1]
    passed = FIXTURE["passthrough"][0][1]
    assert formatted[0]["text"].startswith("You write short slogans.") and passed[0]["text"].startswith("Write a")
    assert formatted[0]["text"].endswith(passed[0]["text"])


def test_the_positional_reward_gets_lists_and_batch_items(task_file):
    data = RolloutDataModule(train_path=task_file, agent_prompts=FORMATTERS, reward_fn=length_reward)
    steps = data.env.step(data.env.reset(TASKS), COMPLETIONS, turn=0, last=True)
    want = [1.0 / (1 + len(a) + len(b)) for a, b in COMPLETIONS]
    assert steps.rewards[:, 0].tolist() == pytest.approx(want)


def test_a_format_string_that_would_drop_the_transition_s_prompt_is_refused(task_file):
    with pytest.raises(ConfigError, match=r"agent_prompts\[1\].*does not use \{prompt\}.*external_prompt_passthrough"):
        RolloutDataModule(
            train_path=task_file,
            agent_prompts=["{prompt}", "About {topic}"],
            reward_fn=length_reward,
            transition=custom_external,
            num_turns=2,
        )


@pytest.mark.parametrize(
    "reward, match",
    [
        (lambda prompts, a, b: [0.0], "takes prompts"),
        (lambda a, b, c: [0.0], "takes 3 positional arguments"),
    ],
)
def test_reward_signatures_lit_marl_cannot_call_are_named(task_file, reward, match):
    with pytest.raises(ConfigError, match=match):
        RolloutDataModule(train_path=task_file, agent_prompts=FORMATTERS, reward_fn=reward)


def test_the_cli_with_the_parity_preset_builds_comlrl_s_prompts(task_file, tmp_path, monkeypatch):
    from lit_marl.cli import build_cli

    monkeypatch.chdir(Path(__file__).parents[2])
    config = tmp_path / "port.yaml"
    config.write_text(
        "model:\n  class_path: lit_marl.algorithms.MAGRPO\n  init_args: {model: tiny-random}\n"
        "data:\n  class_path: lit_marl.data.RolloutDataModule\n  init_args:\n"
        f"    train_path: {task_file}\n"
        "    agent_prompts: [{formatter: comlrl_port:writer}, {formatter: comlrl_port:critic}]\n"
        "    reward_fn: comlrl_port:length_reward\n"
        "    transition: comlrl_port:custom_external\n"
        "    num_turns: 2\n"
    )
    cli = build_cli(args=["--config", str(config), "--config", "configs/comlrl/magrpo.yaml"], run=False)
    assert cli.datamodule.tree.chat_template is False and cli.datamodule.tree.early_termination_threshold == -0.2
    expected = [[[agent["text"] for agent in turn] for turn in task] for task in FIXTURE["formatted"]]
    assert two_turns(cli.datamodule.env) == expected


def test_the_port_trains_through_the_cli_with_the_preset(task_file, tmp_path, monkeypatch):
    """One training step of the ported script (tiny model): every branch's turn-2 prompts are the
    CoMLRL formatters applied to custom_external's prompts, tokenized without a chat template."""
    import comlrl_port

    from lit_marl.agents import Agent
    from lit_marl.cli import build_cli
    from lit_marl.envs.base import FunctionEnv

    monkeypatch.chdir(Path(__file__).parents[2])
    seen, encoded = [], []
    observe, encode = FunctionEnv.observe, Agent.encode_prompt
    monkeypatch.setattr(FunctionEnv, "observe", lambda self, task, p: seen.append((task, p)) or observe(self, task, p))
    monkeypatch.setattr(Agent, "encode_prompt", lambda self, t, raw=False: encoded.append(raw) or encode(self, t, raw))
    config = tmp_path / "port.yaml"
    config.write_text(
        "trainer: {max_steps: 1, logger: false, enable_checkpointing: false, accelerator: cpu}\n"
        "model:\n  class_path: lit_marl.algorithms.MAGRPO\n  init_args: {model: tiny-random, memory: {check: false}}\n"
        "data:\n  class_path: lit_marl.data.RolloutDataModule\n  init_args:\n"
        f"    train_path: {task_file}\n"
        "    agent_prompts: [{formatter: comlrl_port:writer}, {formatter: comlrl_port:critic}]\n"
        "    reward_fn: comlrl_port:length_reward\n"
        "    transition: comlrl_port:custom_external\n"
        "    num_turns: 2\n    num_generations: 2\n    tasks_per_step: 2\n    sampling: {max_new_tokens: 8}\n"
        "    early_termination_threshold: null\n"
    )
    args = ["fit", "--config", "configs/comlrl/magrpo.yaml", "--config", str(config)]
    cli = build_cli(args=args)
    assert cli.trainer.global_step >= 1 and encoded and all(encoded)  # raw: no chat template
    assert len(seen) == 2 * 2  # 2 tasks x G=2 aligned joint actions go on to turn 2
    for task, prompts in seen:
        for p in prompts:
            assert p.startswith(task["prompt"] + "\nPrevious attempt: ") and p.endswith("\nPlease revise.")
        formatted = observe(cli.datamodule.env, task, prompts)
        assert formatted == [comlrl_port.writer({**task, "prompt": prompts[0]}), comlrl_port.critic(task, prompts[1])]


def test_a_reward_set_on_the_env_is_the_one_called(task_file):
    data = RolloutDataModule(train_path=task_file, agent_prompts=FORMATTERS, reward_fn=length_reward)
    data.env.reward_fn = lambda agent_completions, tasks: [7.0] * len(tasks)  # lit_marl's shape now
    steps = data.env.step(data.env.reset(TASKS), COMPLETIONS, turn=0, last=True)
    assert steps.rewards[:, 0].tolist() == [7.0, 7.0]
