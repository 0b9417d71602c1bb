"""MADPO on the tiny random model: the update's gradient is the joint DPO loss's, fits move every
agent, the reference-anchored loss starts at log 2, the offline candidates come from the initial weights."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from helpers import LENGTH_REWARD, length_reward, make_trainer, slogan_data, snapshot, tree_from_functions, unchanged
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.algorithms import MADPO
from lit_marl.generation import Sampling
from lit_marl.generation.base import TrainerWeights
from lit_marl.logprobs import completion_logprobs
from lit_marl.losses import joint_dpo, masked_sum
from lit_marl.rollout.pairs import rollout_pairs

TASKS = [{"topic": "tea"}, {"topic": "winter"}]
PROMPTS = [[f"agent {i}: a slogan for {t['topic']}" for i in range(2)] for t in TASKS]


def _candidates(module, K=4):
    torch.manual_seed(0)
    return tree_from_functions(
        list(module.agents), TASKS, PROMPTS, length_reward, num_generations=K, sampling=Sampling(max_new_tokens=12)
    )


def _direct_gradient(module, batch, role, chosen, rejected):
    """Autograd of the mean over pairs of -log sigmoid(beta (D_role + sg(sum of the others' D))), each D
    minus the initial weights' log-ratio where the loss is reference-anchored."""

    def sequence_logprob(model, s):
        return masked_sum(
            completion_logprobs(model, s.input_ids, s.attention_mask, s.num_completion), s.completion_mask
        )

    deltas = []
    for i, s in enumerate(batch.agents):
        with torch.set_grad_enabled(i == role):
            lp = sequence_logprob(module.agents[i].model, s)
        if module.dpo_reference == "initial":  # minus the frozen initial copy's log-ratio (a constant)
            with torch.no_grad():
                reference = sequence_logprob(module.references[i], s)
            lp = lp - reference
        deltas.append(lp[chosen] - lp[rejected])
    model = module.agents[role].model
    model.zero_grad(set_to_none=True)
    joint_dpo(torch.stack(deltas), role, module.dpo_beta).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dpo_reference", ["none", "initial"])
def test_update_gradient_equals_the_joint_dpo_loss_gradient(dpo_reference):
    L.seed_everything(0)
    module = MADPO(
        model="tiny-random", num_agents=2, dpo_beta=0.5, dpo_reference=dpo_reference, memory={"forward_batch_size": 3}
    )
    module.configure_model()
    for p in module.agents[0].model.parameters():  # the policy moves away from its reference
        p.data.add_(0.02 * torch.randn_like(p))
    batch = _candidates(module)
    pairs = rollout_pairs(batch, module.pair_settings, module.shuffle_generator)
    chosen, rejected = pairs.chosen, pairs.rejected
    assert len(chosen) >= 4 and (pairs.gaps > 0).all()
    deltas = torch.stack([module.log_ratios(i, s, chosen, rejected) for i, s in enumerate(batch.agents)])
    for role in range(2):
        (weight,) = module.candidate_weights(deltas, [role], chosen, rejected, len(batch.agents[role]))
        samples = batch.agents[role].with_advantages(-weight)
        model = module.agents[role].model
        model.zero_grad(set_to_none=True)
        for rows in module.micro_batches(samples, shared_prompts=True):  # as update_agent: in passes
            (module.loss(samples.select(rows), None, module.learner_of(role)) / len(chosen)).backward()
        surrogate = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        direct = _direct_gradient(module, batch, role, chosen, rejected)
        assert surrogate.keys() == direct.keys()
        for name in direct:
            # atol: sums over passes in another order differ by ~1e-6 (float32)
            torch.testing.assert_close(surrogate[name], direct[name], rtol=1e-4, atol=1e-5)


def test_fit_moves_every_agent_with_finite_losses(tmp_path):
    L.seed_everything(0)
    module = MADPO(model="tiny-random", num_agents=2, learning_rate=1e-2, candidate_policy="current")
    module.configure_model()
    before = [snapshot(agent.model) for agent in module.agents]
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(
        module, datamodule=slogan_data(reward_fn=LENGTH_REWARD, num_generations=4, sampling={"max_new_tokens": 12})
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert trainer.global_step == 2 * 2  # one optimizer step per agent per training step
    assert metrics["train/pairs"] > 0 and math.isfinite(metrics["train/loss"]), metrics
    assert 0.0 <= metrics["train/dpo_accuracy"] <= 1.0 and metrics["train/reward_gap"] > 0
    for agent, old in zip(module.agents, before):
        assert not unchanged(agent.model, old)
        assert all(torch.isfinite(p).all() for p in agent.model.parameters())


def test_anchored_loss_starts_at_log_2(tmp_path):
    """With LoRA the reference is the base (adapters off): at the first step the policy is its
    reference, every D_i is 0 and the loss is exactly log 2."""
    L.seed_everything(0)
    module = MADPO(model="tiny-random", num_agents=2, lora={"r": 4, "alpha": 8}, dpo_reference="initial")
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(
        module, datamodule=slogan_data(reward_fn=LENGTH_REWARD, num_generations=4, sampling={"max_new_tokens": 12})
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["train/pairs"] > 0
    assert metrics["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["train/joint_delta"] == pytest.approx(0.0, abs=1e-5)


class ProbeEngine(TrainerWeights):
    """The auto engine, and at every call the logits each calling model gives a fixed probe prompt
    (what the model that generates is, at that moment)."""

    def __init__(self, probe: torch.Tensor):
        from lit_marl.generation import make_engine

        self.inner, self.probe, self.seen = make_engine("auto"), probe, []
        self.name = self.inner.name

    def generate_team(self, calls, *args, **kwargs):
        with torch.no_grad():
            self.seen += [agent.model(self.probe).logits for agent, _, _ in calls]
        return self.inner.generate_team(calls, *args, **kwargs)


@pytest.mark.parametrize("lora", [{"r": 4, "alpha": 8}, None])
def test_offline_candidates_come_from_the_initial_weights(tmp_path, lora):
    """Three steps with a large learning rate move the policy; every training rollout still
    generated with a model equal to a fresh, untrained one (adapters off, or the frozen copy)."""
    L.seed_everything(0)
    fresh = Agent("tiny-random").model
    probe = torch.tensor([Agent("tiny-random").encode_prompt("a slogan for tea")])
    module = MADPO(model="tiny-random", num_agents=2, learning_rate=5e-2, lora=lora)
    data = slogan_data(reward_fn=LENGTH_REWARD, num_generations=4, sampling={"max_new_tokens": 12})
    data.engine = ProbeEngine(probe)
    make_trainer(tmp_path, limit_train_batches=3, limit_val_batches=0).fit(module, datamodule=data)
    with torch.no_grad():
        expected, moved = fresh(probe).logits, module.agents[0].model(probe).logits
    assert not torch.allclose(moved, expected, atol=1e-4), "the policy never moved: the check below is void"
    assert len(data.engine.seen) >= 3
    for logits in data.engine.seen:
        torch.testing.assert_close(logits, expected)


def test_a_parameter_shared_team_learns(tmp_path):
    """One model plays both roles: its rows of the two roles share no prompt pass."""
    L.seed_everything(0)
    module = MADPO(model="tiny-random", num_agents=2, learning_rate=1e-2, share_parameters=True)
    module.configure_model()
    before = snapshot(module.agents[0].model)
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(
        module, datamodule=slogan_data(reward_fn=LENGTH_REWARD, num_generations=4, sampling={"max_new_tokens": 12})
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert trainer.global_step == 2 and metrics["train/pairs"] > 0 and math.isfinite(metrics["train/loss"])
    assert math.isfinite(metrics["shared/delta"])
    assert not unchanged(module.agents[0].model, before)


@pytest.mark.parametrize(
    "model_kwargs, data_kwargs, message",
    [
        (
            {"pairs": {"selection": "all"}},
            {},
            r"model.pairs.selection=all keeps every pair, but model.pairs.per_task=16",
        ),
        ({}, {"num_turns": 2, "transition": "lit_marl.rollout.transitions:plain"}, r"data.num_turns=2"),
        ({}, {"joint_mode": "cross"}, r"data.joint_mode='cross'"),
        ({}, {"num_generations": 1}, r"data.num_generations=1"),
        ({"dpo_beta": 0.0}, {}, r"model.dpo_beta=0.0: must be > 0"),
        ({}, {"reward_calls": {"on_reward_error": "skip"}}, r"data.reward_calls.on_reward_error=skip gives a failed"),
    ],
)
def test_bad_settings_name_the_field(tmp_path, model_kwargs, data_kwargs, message):
    with pytest.raises(ConfigError, match=message):
        module = MADPO(model="tiny-random", num_agents=2, **model_kwargs)
        make_trainer(tmp_path).fit(module, datamodule=slogan_data(**data_kwargs))
