"""``lit-marl export`` and ``lit-marl chat`` on a tiny checkpoint: the exported folders load with
transformers and hold the checkpoint's weights (the same logits); chat's greedy replies are each
agent's own ``generate`` on the context the conversation built, turn after turn, from the
checkpoint and from its export alike."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from helpers import SLOGAN_HELDOUT
from lit_marl import ConfigError, chat
from lit_marl.agents import Agent
from lit_marl.export import exported_team
from lit_marl.generation import Sampling, generate
from lit_marl.trained import export_main, load_team

TYPED = "Now shorter.\n\n"  # one line, then an empty one (skipped)


@pytest.fixture(scope="module")
def exported(magrpo_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "team"
    export_main(["--ckpt_path", str(magrpo_checkpoint), "--out", str(out)])
    return out


def test_export_writes_each_agent_with_the_checkpoints_weights(magrpo_checkpoint, exported):
    assert json.loads((exported / "team.json").read_text()) == {"roles": ["agent0", "agent1"], "system_prompt": None}
    saved = torch.load(magrpo_checkpoint, weights_only=True)["state_dict"]
    module, _ = load_team(str(magrpo_checkpoint))
    initial = Agent("tiny-random").model.state_dict()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    for i, agent in enumerate(module.agents):
        model = AutoModelForCausalLM.from_pretrained(exported / f"agent{i}")
        weights = model.state_dict()
        assert weights.keys() == initial.keys()
        assert all(torch.equal(weights[k], saved[f"agents.{i}.model.{k}"]) for k in weights), f"agent {i}"
        assert any(not torch.equal(weights[k], initial[k]) for k in weights), f"agent {i} holds its initial weights"
        assert torch.equal(model(ids).logits, agent.model(ids).logits)


def _chat(monkeypatch, capsys, *argv: str):
    """``lit-marl chat ARGV`` on the held-out task 1 and TYPED, 6 tokens a reply: its stdout and stderr."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(TYPED))
    chat.main(["--task_file", str(SLOGAN_HELDOUT), "--index", "1", "--max_new_tokens", "6", *argv])
    return capsys.readouterr()


def test_chat_replies_are_each_agents_own_greedy_generate(
    magrpo_checkpoint, exported, in_repo_root, monkeypatch, capsys
):
    out = _chat(monkeypatch, capsys, "--ckpt_path", str(magrpo_checkpoint), "--jsonl").out
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["turn"], r["agent"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]

    # the run's prompts on the task row, then the typed line; each reply the agent's own generate
    module, _ = load_team(str(magrpo_checkpoint))
    config = yaml.safe_load((magrpo_checkpoint.parent.parent / "first.yaml").read_text())
    task = [json.loads(line) for line in SLOGAN_HELDOUT.read_text().splitlines()][1]
    for i, agent in enumerate(module.agents):
        messages = [config["data"]["init_args"]["agent_prompts"][i].format(**task), TYPED.splitlines()[0]]
        ids, closed = [], True
        for turn, message in enumerate(messages):
            ids += agent.chat_continuation(message, closed) if ids else agent.encode_prompt(message)
            reply = generate(agent, [ids], 1, sampling=Sampling(max_new_tokens=6, greedy=True))
            new = reply.completion_ids[0][reply.completion_mask[0].bool()].tolist()
            row = rows[2 * turn + i]
            assert (row["message"], row["reply"]) == (message, agent.tokenizer.decode(new, skip_special_tokens=True))
            ids, closed = ids + new, new[-1] == agent.eos_token_id

    # the export chats as the checkpoint does; the run's config gives the prompts
    run_config = magrpo_checkpoint.parent.parent / "magrpo_slogan_tiny" / "version_0" / "config.yaml"
    out = _chat(monkeypatch, capsys, "--model", str(exported), "--config", str(run_config), "--agents", "1").out
    assert out == f"[agent1 is asked] {rows[1]['message']}\n[agent1] {rows[1]['reply']}\n[agent1] {rows[3]['reply']}\n"


def test_chat_refuses_what_it_cannot_do(exported, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="give --config"):  # an export holds no prompts
        _chat(monkeypatch, capsys, "--model", str(exported))
    with pytest.raises(ConfigError, match=r"--agents=\[2\]: the team has 2 agents"):
        _chat(monkeypatch, capsys, "--model", str(exported), "--agents", "2")


def test_a_run_without_the_chat_template_is_talked_to_without_it(
    magrpo_checkpoint, exported, tmp_path, in_repo_root, monkeypatch, capsys
):
    """data.chat_template: false (CoMLRL's prompts, tokenized as they are): each message is a whole
    prompt, as each turn's prompt was in training; the run's other settings are said where they differ."""
    run_config = magrpo_checkpoint.parent.parent / "magrpo_slogan_tiny" / "version_0" / "config.yaml"
    config = yaml.safe_load(run_config.read_text())
    config["data"]["init_args"]["chat_template"] = False
    (tmp_path / "raw.yaml").write_text(yaml.safe_dump(config))
    argv = ("--ckpt_path", str(magrpo_checkpoint), "--config", str(tmp_path / "raw.yaml"), "--agents", "0", "--jsonl")
    said = _chat(monkeypatch, capsys, *argv)
    assert "lit-marl: chatting with data.chat_template=False (the checkpoint had True)\n" == said.err
    rows = [json.loads(line) for line in said.out.splitlines()]
    (agent,) = exported_team(str(exported / "agent0"))
    for row in rows:
        reply = generate(
            agent, [agent.encode_prompt(row["message"], raw=True)], 1, sampling=Sampling(max_new_tokens=6, greedy=True)
        )
        assert row["reply"] == agent.decode(reply.completion_ids, reply.completion_mask)[0]
    assert len(rows) == 2
