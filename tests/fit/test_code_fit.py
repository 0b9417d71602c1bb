"""MAGRPO on the code environment: two turns with level feedback on the tiny model."""

from __future__ import annotations

import torch

from helpers import REPO_ROOT, cli_fit, make_trainer, snapshot, unchanged
from lit_marl.algorithms import MAGRPO
from lit_marl.data import RolloutDataModule
from lit_marl.envs.code import CodeEnv, TestLimits

EASY = REPO_ROOT / "data" / "code"


def test_two_turn_level_feedback_fit(tmp_path, monkeypatch):
    import lightning as L

    seen = []
    transition = CodeEnv.transition

    def recording(self, **kwargs):
        out = transition(self, **kwargs)
        seen.extend(out)
        return out

    monkeypatch.setattr(CodeEnv, "transition", recording)
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    module.configure_model()
    env = CodeEnv(
        roles="aux_main", transition="level_feedback", test_limits=TestLimits(test_timeout_s=1.0, budget_s=3.0)
    )
    data = RolloutDataModule(
        train_path=str(EASY / "easy_train.jsonl"),
        env=env,
        tasks_per_step=2,
        num_generations=2,
        num_turns=2,
        sampling={"max_new_tokens": 16},
    )
    assert data.num_agents == 2
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    for turn in (0, 1):
        for key in ("reward", "level/definitions", "level/syntax", "level/tests_passed", "collab/calls_helper"):
            assert f"turn_{turn}/{key}" in metrics, f"turn_{turn}/{key}"
            assert torch.isfinite(metrics[f"turn_{turn}/{key}"])
    assert len(seen) == 2 * 2  # one child per joint action of the 2 roots (aligned, G=2)
    for aux_prompt, main_prompt in seen:
        assert "Feedback on the team's program:" in aux_prompt and "`aux`" in aux_prompt
        assert "Feedback on the team's program:" in main_prompt and "Your code at turn 1:" in main_prompt
    # the random model writes no function, so every reward ties and no update is due; the losses are finite
    assert torch.isfinite(metrics["agent0/loss"]) and torch.isfinite(metrics["agent1/loss"])


def test_code_config_runs_from_the_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    cli = cli_fit(tmp_path, "--trainer.limit_train_batches=1", config="configs/magrpo/code_tiny_2turn.yaml")
    metrics = cli.trainer.callback_metrics
    assert "turn_1/level/tests_passed" in metrics and "val/level/syntax" in metrics
    assert isinstance(cli.datamodule.env, CodeEnv) and cli.datamodule.env.num_agents == 2


def test_code_env_plays_as_episodes_with_ppo(tmp_path):
    """The code environment through the one protocol as two-turn episodes: each turn's reward is the
    env's reward of that turn's joint program, the level feedback is the next observation (a chat
    continuation), and PPO moves both agents with finite losses."""
    import lightning as L

    from lit_marl.algorithms import PPO
    from lit_marl.data import EpisodeDataModule
    from lit_marl.envs.code import CodeEnv, TestLimits

    L.seed_everything(0)
    env = CodeEnv(
        roles="aux_main", transition="level_feedback", test_limits=TestLimits(test_timeout_s=1.0, budget_s=3.0)
    )
    data = EpisodeDataModule(
        train_path=str(EASY / "easy_train.jsonl"),
        env=env,
        tasks_per_step=2,
        num_generations=1,
        max_turns=2,
        sampling={"max_new_tokens": 16},
    )
    assert data.num_agents == 2
    module = PPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    module.configure_model()
    before = [snapshot(a.model) for a in module.agents]
    seen = []
    original = data.rollout

    def recording(*args, **kwargs):
        batches = original(*args, **kwargs)
        seen.append(batches)
        return batches

    data.rollout = recording
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    (batches,) = seen
    assert len(batches) == 2 and batches[0].rewards.shape == (2, 2)  # two episodes, two turns each
    assert (batches[0].num_turns == 2).all() and batches[0].truncated.all()  # the turn budget ended them
    for i, batch in enumerate(batches):  # turn 2's observation is the level feedback on turn 1's program
        context = module.agents[i].tokenizer.decode(batch.input_ids[0][batch.attention_mask[0].bool()])
        assert context.count("Feedback on the team's program:") == 1
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["agent0/loss"]) and torch.isfinite(metrics["agent1/loss"])
    for agent, weights in zip(module.agents, before):
        assert len(unchanged(agent.model, weights)) < len(weights)
