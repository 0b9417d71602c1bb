"""SFT on demonstrations and the SFT -> RL phase switch: rendering and masks, the budget, the loader's
early epoch end, a tiny run through both phases, and resume in the middle of each phase."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO_ROOT, TEST_SCRIPTS, make_trainer
from lit_marl import ConfigError
from lit_marl.callbacks.phase_switch import PhaseSwitch, parse_split
from lit_marl.rollout.demos import DemoSamples, agent_chats, render_chat, render_demos
from lit_marl.tasks import TaskLoader

CHAT = [
    {"role": "user", "content": "You are in room 1. Exits: east."},
    {"role": "assistant", "content": "east"},
    {"role": "user", "content": "You walk east. You see a key."},
    {"role": "assistant", "content": "take key"},
    {"role": "user", "content": "You take the key."},
    {"role": "assistant", "content": "open door"},
]
CORRIDOR = REPO_ROOT / "data" / "corridor"
SCRIPT = TEST_SCRIPTS / "phase_run.py"


def runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


# --------------------------------------------------------------------------- rendering
def test_rendered_three_turn_chat_masks_exactly_the_assistant_tokens(tiny_agent):
    ids, mask = render_chat(tiny_agent, CHAT)
    tokenizer = tiny_agent.tokenizer
    # the same tokens as the chat template renders the whole conversation (up to the last reply's end)
    whole = tokenizer.apply_chat_template(CHAT, tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    assert ids == whole[: len(ids)]
    assert tokenizer.decode(whole[len(ids) :]).strip() == ""  # only the template's trailing newline is left
    runs = runs_of_ones(mask)
    assert len(runs) == 3
    eos = tiny_agent.eos_token_id
    for (start, end), reply in zip(runs, ("east", "take key", "open door")):
        assert ids[end - 1] == eos  # the end-of-turn token is a target: the policy samples it
        assert tokenizer.decode(ids[start : end - 1]) == reply
    assert sum(mask) == sum(end - start for start, end in runs)


def test_loss_on_last_keeps_only_the_final_reply(tiny_agent):
    ids_all, mask_all = render_chat(tiny_agent, CHAT, "all")
    ids_last, mask_last = render_chat(tiny_agent, CHAT, "last")
    assert ids_all == ids_last
    assert runs_of_ones(mask_last) == runs_of_ones(mask_all)[-1:]


def test_demonstrations_render_per_agent_left_padded(tiny_agents):
    rows = [
        {"task_id": "a", "messages": [CHAT[:2], CHAT]},
        {"task_id": "b", "messages": [CHAT, CHAT[:4]]},
    ]
    out = render_demos(tiny_agents, rows)
    assert len(out) == 2 and all(len(samples) == 2 for samples in out)
    for i, samples in enumerate(out):
        for b, row in enumerate(rows):
            ids, mask = render_chat(tiny_agents[i], row["messages"][i])
            width = samples.input_ids.shape[1]
            assert samples.input_ids[b, width - len(ids) :].tolist() == ids
            assert samples.loss_mask[b, width - len(ids) :].tolist() == mask
            assert int(samples.attention_mask[b].sum()) == len(ids)
    both = DemoSamples.cat(out, tiny_agents[0].pad_token_id)
    assert len(both) == 4 and both.loss_mask.sum() == out[0].loss_mask.sum() + out[1].loss_mask.sum()
    picked = both.select(torch.tensor([0]))
    assert picked.attention_mask[0, 0] == 1  # trimmed to the row's own length


def test_sft_loss_is_the_nll_of_exactly_the_masked_tokens(tiny_agent):
    from lit_marl.logprobs import sequence_logprobs, sft_loss

    rows = [{"messages": [CHAT]}, {"messages": [CHAT[:2]]}, {"messages": [CHAT[:4]]}]
    (samples,) = render_demos([tiny_agent], rows, "last")
    model = tiny_agent.model
    with torch.no_grad():
        every = sequence_logprobs(model, samples.input_ids, samples.attention_mask)
        expected = -(every * samples.loss_mask).sum()
        torch.testing.assert_close(sft_loss(model, samples), expected, rtol=1e-5, atol=1e-5)
        samples.loss_mask.zero_()
        samples.loss_mask[0, -1] = 1  # only the last end token of row 0
        torch.testing.assert_close(sft_loss(model, samples), -every[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "messages, agents, expected",
    [
        (None, 1, "needs a field 'messages'"),
        ([{"role": "assistant", "content": "x"}], 1, "starting with the user"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], 1, "no system message"),
        ([{"role": "user", "content": "u"}], 1, "ending with the assistant"),
        ([CHAT], 2, "holds 1 chats for a team of 2"),
    ],
)
def test_bad_demonstrations_are_named(messages, agents, expected):
    with pytest.raises(ConfigError, match=expected) as error:
        agent_chats({"task_id": "t7", "messages": messages}, agents, "demonstration 't7'")
    assert "'t7'" in str(error.value)


# --------------------------------------------------------------------------- the budget
def test_budget_is_split_between_demonstrations_and_episodes():
    guide = PhaseSwitch(budget=460, split="60:400")
    assert (guide.demos, guide.episodes, guide.phase) == (60, 400, "sft")
    costly = PhaseSwitch(budget=1000, split="1:4", demo_cost=2.0)
    assert (costly.demos, costly.episodes) == (100, 800)
    rl_only = PhaseSwitch(budget=50, split="0:1")
    assert (rl_only.demos, rl_only.episodes, rl_only.phase) == (0, 50, "rl")
    assert parse_split("1:4") == (1.0, 4.0)
    for bad in ("1-4", "a:b", "0:0", "-1:2"):
        with pytest.raises(ConfigError, match="PhaseSwitch.split"):
            parse_split(bad)
    with pytest.raises(ConfigError, match="budget"):
        PhaseSwitch(budget=0)


def test_resuming_with_another_budget_is_refused():
    state = PhaseSwitch(budget=28, split="12:16").state_dict()
    with pytest.raises(ConfigError, match="resume with the same budget"):
        PhaseSwitch(budget=30, split="12:16").load_state_dict(state)


def test_resuming_with_other_sft_epochs_is_refused_and_old_checkpoints_load():
    state = PhaseSwitch(budget=28, split="12:16", sft_epochs=2).state_dict()
    with pytest.raises(ConfigError, match=r"12 demonstrations x 2 SFT epochs \+ 16 episodes, this run's 12 x 1"):
        PhaseSwitch(budget=28, split="12:16").load_state_dict(state)
    old = {k: v for k, v in PhaseSwitch(budget=28, split="12:16").state_dict().items() if k != "sft_epochs"}
    PhaseSwitch(budget=28, split="12:16").load_state_dict(old)  # saved before sft_epochs existed: one pass


def test_sft_epochs_need_no_file_size_when_the_budget_has_no_sft():
    switch = PhaseSwitch(budget=16, split="0:1", sft_epochs=3)
    data = type("Data", (), {"demos": [{}] * 45})()
    switch.setup(type("Trainer", (), {"datamodule": data})(), type("Module", (), {"runs_rl": True})(), "fit")
    assert switch.phase == "rl" and switch.demos_to_serve == 0


def test_loader_epoch_ends_where_the_budget_does():
    rows = [{"i": i} for i in range(10)]
    loader = TaskLoader(rows, batch_size=3, seed=0)
    loader.end_after(5)  # 5 rows -> 2 whole steps of 3
    first = list(loader)
    assert len(loader) == 2 and len(first) == 2
    loader.end_after(None)
    second = list(loader)
    assert len(second) == 4  # the next epoch: the whole permutation, in a new order
    assert [r["i"] for b in second for r in b] != [r["i"] for b in first for r in b][:6] or True
    loader.end_after(100)
    assert len(loader) == 4  # never past the permutation


def test_a_loader_ignores_the_other_phases_saved_position():
    demos = TaskLoader([{"i": i} for i in range(8)], batch_size=4, seed=0, name="demos")
    list(demos)
    demos.consumed = 2
    tasks = TaskLoader([{"i": i} for i in range(5)], batch_size=2, seed=0)
    tasks.load_state_dict(demos.state_dict())  # saved as the SFT epoch ended: RL starts afresh
    assert len(list(tasks)) == 3 and tasks.epoch == 0


# --------------------------------------------------------------------------- runs
def run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=300, env=os.environ
    )


def steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("phase") / "full"
    done = run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_sft_then_ppo_runs_both_phases(full_run):
    """12 demonstrations (3 SFT steps) then 16 episodes (4 PPO steps): the switch at the end of the
    SFT epoch, the SFT loss falling on the demonstrations, finite RL losses after it."""
    log = steps(full_run)
    assert [s["phase"] for s in log] == ["sft"] * 3 + ["rl"] * 4
    assert [s["demos_done"] for s in log] == [4, 8, 12, 12, 12, 12, 12]
    assert [s["episodes_done"] for s in log] == [0, 0, 0, 4, 8, 12, 16]
    assert all(r.startswith("corridor/demo/") for s in log[:3] for r in s["rows"])
    assert all(r.startswith("corridor/train/") for s in log[3:] for r in s["rows"])
    assert [s["epoch"] for s in log] == [0, 0, 0, 1, 1, 1, 1]
    sft_losses = [s["loss"] for s in log[:3]]
    assert sft_losses[2] < sft_losses[1] < sft_losses[0]
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in log[3:])
    state = json.loads((full_run / "phase.json").read_text())
    assert state["phase"] == "rl" and state["switched_at"] == {"epoch": 0, "global_step": 3}

    from lit_marl.agents import Agent

    start = dict(Agent("tiny-random").model.named_parameters())
    trained = torch.load(full_run / "params.pt")
    moved = [n for n, p in start.items() if not torch.equal(trained[f"agents.0.model.{n}"], p)]
    assert len(moved) == len(start)


def test_sft_epochs_repeat_the_budgets_demonstrations(tmp_path):
    """sft_epochs=2: the same 12 demonstrations twice (6 SFT steps, the cost counted once), then 16 episodes."""
    out = tmp_path / "twice"
    done = run(out, "--sft-epochs", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    log = steps(out)
    assert [s["phase"] for s in log] == ["sft"] * 6 + ["rl"] * 4
    assert [s["demos_done"] for s in log] == [4, 8, 12, 16, 20, 24, 24, 24, 24, 24]
    assert [s["epoch"] for s in log] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    first, second = (sorted(r for s in log[k : k + 3] for r in s["rows"]) for k in (0, 3))
    assert first == second and len(set(first)) == 12  # each demonstration once per pass
    assert "after SFT on 12 demonstrations x 2 epochs" in done.stdout
    with pytest.raises(
        ConfigError,
        match=r"PhaseSwitch.sft_epochs=2 repeats the budget's 12 demonstrations, but "
        r"data.demos.path holds 45",
    ):
        switch = PhaseSwitch(budget=28, split="12:16", sft_epochs=2)
        data = type("Data", (), {"demos": [{}] * 45})()
        trainer = type("Trainer", (), {"datamodule": data})()
        switch.setup(trainer, type("Module", (), {"runs_rl": True})(), "fit")


# kills mid-SFT, at the switch (the edge: the phase flips in the resumed run) and mid-RL: each
# ~35-90 s of kill + resume, so all three run in make test-slow
@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_before",
    [1, 3, 5],
    ids=["mid-sft", "at-switch", "mid-rl"],
)
def test_killed_run_resumes_in_its_phase_with_the_rest_of_its_budget(tmp_path, full_run, kill_before):
    cut = tmp_path / "cut"
    killed = run(cut, "--kill-before", str(kill_before))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoint = cut / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("PhaseSwitch")]
    assert state["phase"] == ("sft" if kill_before < 3 else "rl")  # the switch comes with the end of step 2's epoch
    resumed = run(cut, "--resume", str(checkpoint))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(cut) == steps(full_run)  # the same phases, counters, rows and losses, step by step
    assert json.loads((cut / "phase.json").read_text()) == json.loads((full_run / "phase.json").read_text())
    a, b = torch.load(full_run / "params.pt"), torch.load(cut / "params.pt")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


def test_sft_module_learns_the_demonstrations(tmp_path):
    from lit_marl.algorithms import SFT
    from lit_marl.data import EpisodeDataModule

    losses = []

    class Losses(__import__("lightning").Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train/sft_loss"]))

    module = SFT(model="tiny-random", num_agents=1, learning_rate=3e-3)
    data = EpisodeDataModule(
        train_path=str(CORRIDOR / "train.jsonl"),
        env="corridor",
        demos={"path": str(CORRIDOR / "demos.jsonl"), "batch_size": 8},
    )
    trainer = make_trainer(tmp_path, limit_train_batches=3, max_epochs=2, limit_val_batches=0, callbacks=[Losses()])
    trainer.fit(module, datamodule=data)
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0]


def test_sft_needs_demonstrations(tmp_path):
    from lit_marl.algorithms import PPO, SFT
    from lit_marl.data import EpisodeDataModule

    data = EpisodeDataModule(train_path=str(CORRIDOR / "train.jsonl"), env="corridor")
    with pytest.raises(ConfigError, match="data.demos.path"):
        make_trainer(tmp_path).fit(SFT(model="tiny-random", num_agents=1), datamodule=data)
    trainer = make_trainer(tmp_path, callbacks=[PhaseSwitch(budget=10)])
    with pytest.raises(ConfigError, match="data.demos.path"):
        trainer.fit(PPO(model="tiny-random"), datamodule=data)
    demos = EpisodeDataModule(
        train_path=str(CORRIDOR / "train.jsonl"), env="corridor", demos={"path": str(CORRIDOR / "demos.jsonl")}
    )
    trainer = make_trainer(tmp_path, callbacks=[PhaseSwitch(budget=10)])
    with pytest.raises(ConfigError, match="set model to an RL algorithm"):
        trainer.fit(SFT(model="tiny-random", num_agents=1), datamodule=demos)


def test_sft_then_magrpo_config_runs_both_phases_per_agent(in_repo_root, tmp_path):
    """configs/magrpo/code_sft_tiny.yaml: each agent fine-tunes on its own role's demonstrations
    (helper / entry point), then MAGRPO spends 16 episodes = joint trajectories of 2-turn trees."""
    from helpers import cli_fit

    cli = cli_fit(tmp_path, config="configs/magrpo/code_sft_tiny.yaml")
    (switch,) = [c for c in cli.trainer.callbacks if isinstance(c, PhaseSwitch)]
    assert (switch.phase, switch.demos_done, switch.episodes_done) == ("rl", 8, 16)
    assert switch.switched_at == {"epoch": 0, "global_step": 4}  # 2 SFT steps x 2 agents' optimizers
    metrics = cli.trainer.callback_metrics
    assert float(metrics["train/episodes"]) == 8  # 2 tasks x G^T = 2^2 leaves
    for name in ("agent0/sft_loss", "agent1/sft_loss", "agent0/loss", "agent1/loss"):
        assert torch.isfinite(metrics[name]), name
