"""Tiny-model smoke fits on the project's ALFWorld games, and per-task-type held-out success."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import make_trainer
from lit_marl.agents import Agent
from lit_marl.algorithms import GRPO, PPO
from lit_marl.data import EpisodeDataModule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TYPES = ["pick_and_place_simple", "pick_heat_then_place_in_recep"]


def data_module(**kwargs):
    settings = dict(
        train_path="alfworld:train:1",
        val_path="alfworld:test:2",
        env="alfworld",
        tasks_per_step=2,
        max_turns=3,
        max_new_tokens=6,
        max_context_tokens=4096,
        reward_density="dense",
    )
    return EpisodeDataModule(**{**settings, **kwargs})


def fit(tmp_path, module, num_generations):
    L.seed_everything(0)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = data_module(num_generations=num_generations, task_types=TYPES)
    assert sorted({t["task_type"] for t in data.train_tasks}) == TYPES
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    moved = {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}
    return trainer.callback_metrics, moved


def test_ppo_on_alfworld_moves_policy_and_critic(tmp_path):
    metrics, moved = fit(tmp_path, PPO(model="tiny-random", learning_rate=1e-2), 1)
    for key in ("train/loss", "train/turn0/reward", "train/won", "train/explained_variance"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert any(n.startswith("agents.0.") for n in moved) and any(n.startswith("value_heads.0.") for n in moved)


def test_grpo_on_alfworld_runs(tmp_path):
    metrics, _ = fit(tmp_path, GRPO(model="tiny-random", learning_rate=1e-2), 2)
    for key in ("train/loss", "train/turn0/reward", "train/reward"):
        assert key in metrics and torch.isfinite(metrics[key]), key


def test_held_out_success_per_task_type():
    """``won/<task type>`` is the win rate over that type's held-out games alone; the overall
    ``won`` is over all of them. A scripted team that plays each game's plan only for some types
    checks both, through batches that mix the types."""
    data = data_module(eval_tasks_per_step=5)
    plans = {t["game"]: [c[0] for c in data.make_env().expert_turns(t)] for t in data.val_tasks}
    solved = {"pick_and_place_simple", "look_at_obj_in_light"}

    def scripted(agents, tasks, greedy):  # wins exactly the games of the solved types
        batches = EpisodeDataModule.rollout(data, agents, tasks, greedy)
        won = torch.tensor([t["task_type"] in solved for t in tasks])
        batches[0].won = won
        return batches

    data.rollout = scripted
    results = data.evaluate([Agent("tiny-random")])
    assert len(plans) == 12
    for kind in {t["task_type"] for t in data.val_tasks}:
        assert results[f"won/{kind}"] == (1.0 if kind in solved else 0.0), kind
    assert results["won"] == pytest.approx(4 / 12)
    only = data_module(task_types=["look_at_obj_in_light"])
    assert {t["task_type"] for t in only.val_tasks} == {"look_at_obj_in_light"} and len(only.val_tasks) == 2
