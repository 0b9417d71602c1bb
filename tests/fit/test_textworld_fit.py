"""Tiny-model smoke fits on generated TextWorld games through the episode data module."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import make_trainer
from lit_marl.algorithms import GRPO, PPO, RLOO
from lit_marl.data import EpisodeDataModule
from lit_marl.envs.textworld.games import write_tasks


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two training games of the guide's base complexity."""
    return write_tasks("w2-o3-q4", "train", 2, tmp_path_factory.mktemp("textworld"))


def fit(tmp_path, module, tasks, num_generations):
    L.seed_everything(0)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = EpisodeDataModule(
        train_path=str(tasks),
        env="textworld",
        tasks_per_step=2,
        num_generations=num_generations,
        max_turns=3,
        sampling={"max_new_tokens": 6},
        max_context_tokens=4096,
        reward_density="dense",
    )
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    moved = {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}
    return trainer.callback_metrics, moved


def test_ppo_on_textworld_moves_policy_and_critic(tmp_path, tasks):
    metrics, moved = fit(tmp_path, PPO(model="tiny-random", learning_rate=1e-2), tasks, 1)
    for key in ("train/loss", "turn_0/reward", "train/won", "agent0/explained_variance"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert any(n.startswith("agents.0.") for n in moved) and any(n.startswith("value_heads.0.") for n in moved)


@pytest.mark.parametrize("algorithm", [GRPO, RLOO])
def test_group_algorithms_run_on_textworld(tmp_path, tasks, algorithm):
    """Random play earns the same (zero) reward in every episode of a group: the group baseline
    gives zero advantages and the policy rightly stays; the update runs and its loss is finite."""
    metrics, moved = fit(tmp_path, algorithm(model="tiny-random", learning_rate=1e-2), tasks, 2)
    for key in ("train/loss", "turn_0/reward", "train/reward"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    if float(metrics["train/reward_std"] if "train/reward_std" in metrics else 0.0) == 0.0:
        assert not any(n.startswith("agents.0.") for n in moved)
