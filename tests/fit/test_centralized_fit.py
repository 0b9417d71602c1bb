"""CentralizedMAGRPO on the tiny random model: one joint actor learns, its reward comes through the roles."""

from __future__ import annotations

import math

import lightning as L
import pytest

from helpers import LENGTH_REWARD, make_trainer, slogan_data, snapshot, unchanged
from lit_marl import ConfigError
from lit_marl.algorithms import CentralizedMAGRPO

HALVES = "helpers:HalvesAdapter"


def test_one_joint_actor_learns_from_the_roles_reward(tmp_path):
    L.seed_everything(0)
    data = slogan_data(reward_fn=LENGTH_REWARD, centralized_adapter=HALVES, sampling={"max_new_tokens": 12})
    assert data.num_agents == 1 and data.env.roles == 2
    module = CentralizedMAGRPO(model="tiny-random", num_agents=1, learning_rate=1e-2)
    module.configure_model()
    before = snapshot(module.agents[0].model)
    trainer = make_trainer(tmp_path)
    trainer.fit(module, datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert trainer.global_step == 2
    assert metrics["agent0/advantage_abs"] > 0 and math.isfinite(metrics["agent0/loss"])
    assert metrics["train/parse_failed"] == 0.0  # the halves adapter always parses
    assert not unchanged(module.agents[0].model, before)


def test_tagged_adapter_failures_are_logged_not_fatal(tmp_path):
    """The random model writes no tags: every completion is a parse failure, scored 0 and counted."""
    L.seed_everything(0)
    data = slogan_data(centralized_adapter="lit_marl.envs.centralized:TaggedAdapter", sampling={"max_new_tokens": 8})
    trainer = make_trainer(tmp_path, limit_train_batches=1)
    trainer.fit(CentralizedMAGRPO(model="tiny-random", num_agents=1), datamodule=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/parse_failed"] == 1.0 and metrics["train/reward"] == 0.0
    assert metrics["val/parse_failed"] == 1.0 and metrics["val/success"] == 0.0


def test_centralized_magrpo_without_an_adapter_or_with_turns_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="CentralizedMAGRPO needs a joint actor: set data.centralized_adapter"):
        make_trainer(tmp_path).fit(CentralizedMAGRPO(model="tiny-random", num_agents=2), datamodule=slogan_data())
    with pytest.raises(ConfigError, match="data.centralized_adapter: a joint actor plays one turn; data.num_turns=2"):
        slogan_data(centralized_adapter=HALVES, num_turns=2, transition="lit_marl.rollout.transitions:plain")
