"""A parameter-shared team: one model plays every role."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import make_trainer, slogan_data, tree_from_functions
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.generation import Sampling
from lit_marl.rollout.transitions import plain

TASKS = [{"topic": "tea"}, {"topic": "winter"}]
PROMPTS = [[f"agent {i}: write about {t['topic']}" for i in range(3)] for t in TASKS]


def test_one_generate_per_turn_for_all_roles(tiny_agent):
    from helpers import RecordingEngine

    engine = RecordingEngine()
    team = [tiny_agent] * 3
    batch = tree_from_functions(
        team,
        TASKS,
        PROMPTS,
        lambda agent_completions, tasks: [0.0] * len(tasks),
        2,
        sampling=Sampling(max_new_tokens=3),
        num_turns=2,
        transition=plain,
        engine=engine,
    )
    calls = [len(prompts) for _, prompts, _ in engine.calls]
    assert calls == [3 * 2, 3 * 4]  # turn 0: 3 roles x 2 roots; turn 1: 3 roles x 4 children
    # each role's rows hold that role's own prompts
    for role in range(3):
        samples = batch.agents[role]
        C = samples.num_completion
        for t in range(len(TASKS)):
            row = t * 2  # first sample of task t's root
            prompt = samples.input_ids[row, :-C][samples.attention_mask[row, :-C].bool()].tolist()
            assert prompt == tiny_agent.encode_prompt(PROMPTS[t][role])


def test_shared_fit_updates_the_one_model(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, share_parameters=True)
    module.configure_model()
    assert module.agents[0] is module.agents[1]
    before = {n: p.detach().clone() for n, p in module.agents[0].model.named_parameters()}
    trainer = make_trainer(tmp_path, limit_train_batches=2, limit_val_batches=0)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    assert len(trainer.optimizers) == 1
    assert trainer.global_step == 2  # one optimizer step per training step for the one model
    changed = [n for n, p in module.agents[0].model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed
    assert torch.isfinite(trainer.callback_metrics["shared/loss"])


def test_shared_parameters_need_one_source():
    with pytest.raises(ConfigError, match="share_parameters=true needs one model source"):
        MAGRPO(model=["tiny-random", "./elsewhere"], num_agents=2, share_parameters=True)
