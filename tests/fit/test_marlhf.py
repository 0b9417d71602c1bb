"""MARLHF on the tiny random model: the joint reward model's text, save/load, learning a preference
with Bradley-Terry, the fit phase, and online training on the learned reward (evaluation on the task's)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from helpers import LENGTH_REWARD, make_trainer, slogan_data, snapshot, unchanged
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO, RewardModelFit
from lit_marl.envs.learned import JointRewardModel, joint_text
from lit_marl.losses import bradley_terry


def test_joint_text_is_comlrls_layout():
    assert joint_text(["p0", "p1"], ["a", "b"]) == (
        "Joint multi-agent response\n\nAgent 1 prompt:\np0\n\nAgent 1 response:\na"
        "\n\nAgent 2 prompt:\np1\n\nAgent 2 response:\nb"
    )


def test_scores_do_not_depend_on_padding_and_survive_save_and_load(tmp_path):
    torch.manual_seed(0)
    model = JointRewardModel("tiny-random").eval()
    texts = ["short answer", "a much longer joint answer with many more words in it than the first"]
    with torch.no_grad():
        together = model.score(texts)
        alone = torch.cat([model.score([t]) for t in texts])
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
        model.save(tmp_path / "rm")
        loaded = JointRewardModel.load(tmp_path / "rm")
        torch.testing.assert_close(loaded.score(texts), together)
    with pytest.raises(ConfigError, match="holds no trained reward model"):
        JointRewardModel.load(tmp_path)


def test_bradley_terry_teaches_a_preference():
    """Longer answers preferred: after some steps on 6 pairs the model ranks every pair right."""
    torch.manual_seed(0)
    model = JointRewardModel("tiny-random")
    chosen = [f"answer {'word ' * (8 + i)}" for i in range(6)]
    rejected = [f"answer {'word ' * i}" for i in range(6)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = bradley_terry(model.score(chosen), model.score(rejected)).mean()
        first = float(loss.detach()) if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        assert (model.score(chosen) > model.score(rejected)).all()
    assert float(loss) < first * 0.5


def test_fit_the_reward_model_then_train_on_it(tmp_path):
    L.seed_everything(0)
    folder = tmp_path / "rm"
    module = RewardModelFit(model="tiny-random", num_agents=2, reward_learning_rate=1e-3, reward_model_dir=str(folder))
    module.configure_model()
    team_before = [{n: p.detach().clone() for n, p in a.model.named_parameters()} for a in module.agents]
    rm_before = snapshot(module.reward_net)
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(
        module, datamodule=slogan_data(reward_fn=LENGTH_REWARD, num_generations=4, sampling={"max_new_tokens": 12})
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/pairs"] > 0 and math.isfinite(metrics["train/loss"])
    assert 0.0 <= metrics["train/rm_accuracy"] <= 1.0
    # the reward model learned; the head's bias cancels in s_w - s_l: Bradley-Terry gives it no gradient
    assert unchanged(module.reward_net, rm_before) == ["head.bias"]
    for agent, before in zip(module.agents, team_before):  # the team only sampled
        assert all(torch.equal(p, before[n]) for n, p in agent.model.named_parameters())
    assert (folder / "reward_head.pt").exists()

    # phase 2: MAGRPO rewarded by the model; held-out evaluation keeps the task reward
    data = slogan_data(reward_fn=LENGTH_REWARD, reward_model=str(folder), sampling={"max_new_tokens": 12})
    rm = data.train_env.model
    batch = data.rollout([module.agents[0], module.agents[1]], data.train_tasks[:2], greedy=False)
    texts = [
        joint_text([p[j] for p in batch.prompts], [c[j] for c in batch.completions]) for j in range(len(batch.rewards))
    ]
    with torch.no_grad():
        torch.testing.assert_close(batch.rewards, rm.score(texts), rtol=1e-4, atol=1e-5)
    greedy = data.rollout([module.agents[0], module.agents[1]], data.val_tasks[:2], greedy=True)
    lengths = [min(1.0, sum(len(c[j]) for c in greedy.completions) / 200.0) for j in range(2)]
    assert greedy.rewards.tolist() == pytest.approx(lengths)
    policy = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    make_trainer(tmp_path, limit_train_batches=1).fit(policy, datamodule=data)


def test_reward_model_fit_refuses_multi_turn_and_a_capped_all(tmp_path):
    with pytest.raises(ConfigError, match="model.pairs.selection=all keeps every pair"):
        RewardModelFit(model="tiny-random", num_agents=2, pairs={"selection": "all"})
    with pytest.raises(ConfigError, match="model.pairs.selection=comparator_reward orders pairs against a comparator"):
        RewardModelFit(model="tiny-random", num_agents=2, pairs={"selection": "comparator_reward"})
    with pytest.raises(
        ConfigError, match="RewardModelFit compares whole joint candidates of one turn: data.num_turns=2"
    ):
        make_trainer(tmp_path).fit(
            RewardModelFit(model="tiny-random", num_agents=2),
            datamodule=slogan_data(num_turns=2, transition="lit_marl.rollout.transitions:plain"),
        )


def test_the_documented_two_commands_run(in_repo_root, tmp_path):
    """configs/marlhf/reward_model_tiny.yaml, then a MAGRPO config on its reward model, through the CLI
    (the model's and the data's settings are one hparams namespace to Lightning: no name may clash)."""
    from helpers import cli_fit

    folder = tmp_path / "rm"
    cli = cli_fit(
        tmp_path, "--model.init_args.reward_model_dir", str(folder), config="configs/marlhf/reward_model_tiny.yaml"
    )
    assert cli.trainer.state.finished and (folder / "reward_head.pt").exists()
    cli = cli_fit(tmp_path, "--data.init_args.reward_model", str(folder), config="configs/magrpo/slogan_tiny.yaml")
    assert cli.trainer.state.finished and isinstance(cli.datamodule.train_env.model, JointRewardModel)
