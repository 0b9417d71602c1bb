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
        sampling={"max_new_tokens": 6},
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
    for key in ("train/loss", "turn_0/reward", "train/won", "agent0/explained_variance"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert any(n.startswith("agents.0.") for n in moved) and any(n.startswith("value_heads.0.") for n in moved)


def test_grpo_on_alfworld_runs(tmp_path):
    metrics, _ = fit(tmp_path, GRPO(model="tiny-random", learning_rate=1e-2), 2)
    for key in ("train/loss", "turn_0/reward", "train/reward"):
        assert key in metrics and torch.isfinite(metrics[key]), key


def test_held_out_success_per_task_type():
    """``won/<task type>`` is the win rate over that type's held-out games alone, ``won`` over all,
    with wins that differ inside a type and across batch boundaries (5 tasks a batch). (Two ranks
    each playing their share: tests/distributed, ``test_evaluation_metrics_and_step_logs_sync``.)"""
    data = data_module(eval_tasks_per_step=5, max_turns=1)  # the outcome is scripted: one turn is enough
    tasks = data.val_tasks
    assert len(tasks) == 12
    winners = {t["game"] for t in tasks if t["seed"] == 1} | {t["game"] for t in tasks if t["task_type"] == TYPES[0]}

    def scripted(agents, batch, greedy, group_size=None):  # the episodes are played; the outcome is scripted
        episodes = EpisodeDataModule.rollout(data, agents, batch, greedy, group_size)
        episodes[0].won = torch.tensor([t["game"] in winners for t in batch])
        return episodes

    data.rollout = scripted
    alone = data.evaluate([Agent("tiny-random")])
    for kind in {t["task_type"] for t in tasks}:
        expected = 1.0 if kind == TYPES[0] else 0.5
        assert alone[f"won/{kind}"] == expected, kind
    assert alone["won"] == pytest.approx(7 / 12)


def test_task_types_filter_held_out_games_and_demonstrations(tmp_path):
    import json
    from pathlib import Path

    from lit_marl import ConfigError
    from lit_marl.envs.sources import resolve_source

    only = data_module(task_types=["pick_heat_then_place"], demos={"path": "alfworld:validation:1"})  # a short name
    assert {t["task_type"] for t in only.val_tasks} == {"pick_heat_then_place_in_recep"} and len(only.val_tasks) == 2
    assert [d["task_type"] for d in only.demos] == ["pick_heat_then_place_in_recep"]
    rows = [json.loads(x) for x in Path(resolve_source("alfworld:test:1")).read_text().splitlines()]
    held_out = tmp_path / "val.jsonl"  # held-out games of every type but one
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows if r["task_type"] != "pick_two_obj_and_place"))
    with pytest.raises(ConfigError, match=r"data.val_path holds no rows of \['pick_two_obj_and_place'\]"):
        data_module(val_path=str(held_out), task_types=["pick_two_obj_and_place", "look_at_obj_in_light"])
