"""Truncated importance sampling against the rollout engine's log-probs: the pure weight, and the
policy terms of MAGRPO and of the episode family reweighted token by token (and only those)."""

from __future__ import annotations

import pytest
import torch

from lit_marl.algorithms import GRPO, MAGRPO
from lit_marl.generation import Sampling, TorchEngine
from lit_marl.logprobs import completion_logprobs, masked_logprobs
from lit_marl.losses import clipped_surrogate, truncated_is_weights
from lit_marl.metrics import StepLog, record_rollout_mismatch
from lit_marl.rollout.batch import AgentSamples, TrajectorySamples


def test_truncated_is_weights_are_the_capped_ratio_without_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -1.0, -2.0]])
    weights = truncated_is_weights(logprobs, rollout, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, torch.e**-1, 2.0]]))  # e^1.5 = 4.5 capped at 2
    assert not weights.requires_grad
    assert truncated_is_weights(torch.tensor([0.0]), torch.tensor([-200.0]), 3.0).item() == 3.0  # no overflow


def test_the_mismatch_is_logged_over_sampled_tokens_only():
    log = StepLog()
    logprobs = torch.tensor([[-1.0, -2.0, -7.0]])
    rollout = torch.tensor([[-1.5, -2.0, 0.0]])
    record_rollout_mismatch(log, logprobs, rollout, torch.tensor([[1, 1, 0]]), cap=1.2)
    scalars, _ = log.reduce()
    assert scalars["train/rollout_logp_diff"] == pytest.approx(0.25)
    assert scalars["train/rollout_ratio"] == pytest.approx((torch.e**0.5 + 1) / 2)
    assert scalars["train/rollout_ratio_max"] == pytest.approx(torch.e**0.5)
    assert scalars["train/rollout_is_capped_frac"] == pytest.approx(0.5)


def _tree_samples(agent, shift: torch.Tensor) -> AgentSamples:
    torch.manual_seed(0)
    prompts = [agent.tokenizer("a b c")["input_ids"], agent.tokenizer("d e")["input_ids"]]
    gen = TorchEngine().generate(agent, prompts, 2, Sampling(max_new_tokens=6))
    width = gen.completion_ids.shape[1]
    return AgentSamples(
        input_ids=torch.cat([gen.prompt_ids, gen.completion_ids], 1),
        attention_mask=torch.cat([gen.prompt_mask, gen.completion_mask], 1),
        completion_mask=gen.completion_mask,
        returns=torch.zeros(4),
        group_ids=torch.tensor([0, 0, 1, 1]),
        turn_ids=torch.zeros(4, dtype=torch.long),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        rollout_logprobs=(gen.logprobs - shift[:width]) * gen.completion_mask,
    )


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_magrpo_weighs_each_tokens_term_by_the_capped_ratio(reduction):
    module = MAGRPO(model="tiny-random", num_agents=1, update={"rollout_is_cap": 2.0, "logprob_reduction": reduction})
    module.configure_model()
    model = module.agents[0].model
    shift = torch.tensor([0.0, 1.5, -0.7, 0.3, 2.0, -1.0])  # log pi - log pi_rollout per column
    samples = _tree_samples(module.agents[0], shift)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(module.loss(samples, None, 0), params)
    logp = completion_logprobs(model, samples.input_ids, samples.attention_mask, samples.num_completion)
    weights = (logp.detach() - samples.rollout_logprobs).exp().clamp(max=2.0)
    assert (weights[samples.completion_mask.bool()] == 2.0).any() and (weights < 0.9).any()
    mask = samples.completion_mask.float()
    per_row = (weights * logp * mask).sum(-1)
    if reduction == "mean":
        per_row = per_row / mask.sum(-1)
    expected = torch.autograd.grad(-(samples.advantages * per_row).sum(), params)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    # the engine's own distribution (ratio 1 everywhere): the plain REINFORCE gradient
    same = AgentSamples(**{**vars(samples), "rollout_logprobs": logp.detach() * mask})
    plain = MAGRPO(model="tiny-random", num_agents=1, update={"logprob_reduction": reduction})
    plain.configure_model()
    plain.load_state_dict(module.state_dict())
    a = torch.autograd.grad(module.loss(same, None, 0), params)
    b = torch.autograd.grad(plain.loss(same, None, 0), list(plain.agents[0].model.parameters()))
    for got, want in zip(a, b):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-3)


def test_episode_policy_terms_are_reweighted_and_nothing_else():
    module = GRPO(model="tiny-random", update={"rollout_is_cap": 1.5, "clip_range": 0.2}, kl={"coef": 0.1})
    module.configure_model()
    model = module.agents[0].model
    torch.manual_seed(1)
    ids = torch.randint(5, 100, (3, 12))
    attention = torch.ones_like(ids)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 4:8] = 1
    loss_mask[:, 10:] = 1
    with torch.no_grad():
        logp = masked_logprobs(model, ids, attention, loss_mask)[0]
    old = logp + 0.1 * torch.randn_like(logp)
    rollout = old - torch.randn_like(old)
    samples = TrajectorySamples(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        advantages=torch.randn(3, 12),
        old_logprobs=old * loss_mask,
        returns=torch.zeros(3),
        old_values=torch.zeros(3, 12),
        value_mask=torch.zeros(3, 12),
        ref_logprobs=(logp - 0.2) * loss_mask,
        rollout_logprobs=rollout * loss_mask,
        group_ids=torch.arange(3),
        turn_ids=torch.zeros(3, dtype=torch.long),
    )
    stats = dict.fromkeys(("approx_kl", "clip_frac", "tokens"), 0.0)
    policy = module.loss(samples, stats, 0)[0]
    new = masked_logprobs(model, ids, attention, loss_mask)[0]
    mask = loss_mask.float()
    weights = truncated_is_weights(samples.old_logprobs, samples.rollout_logprobs, 1.5)
    assert (weights[mask.bool()] == 1.5).any() and (weights[mask.bool()] < 1).any()
    surrogate = clipped_surrogate(new, samples.old_logprobs, samples.advantages, 0.2)
    from lit_marl.losses import k3_kl

    kl = 0.1 * (k3_kl(samples.ref_logprobs - new) * mask).sum()  # the KL term is not reweighted
    torch.testing.assert_close(policy, (surrogate * weights * mask).sum() + kl, atol=1e-5, rtol=1e-5)
    assert stats["tokens"] == float(mask.sum())


def test_actor_critic_policy_terms_are_reweighted_and_the_value_term_is_not():
    from lit_marl.algorithms import IAC
    from lit_marl.losses import masked_sum

    module = IAC(model="tiny-random", num_agents=1, update={"rollout_is_cap": 1.5}, policy_loss="ppo")
    module.configure_model()
    samples = _tree_samples(module.agents[0], torch.zeros(6))
    logprobs, _, values = module.actor_forward(0, samples, entropy=False)
    old = (logprobs.detach() + 0.1 * torch.randn_like(logprobs)) * samples.completion_mask
    rollout = old - torch.randn_like(old) * samples.completion_mask
    samples = AgentSamples(
        **{
            **vars(samples),
            "old_logprobs": old,
            "rollout_logprobs": rollout,
            "old_values": torch.zeros(4),
            "targets": torch.ones(4),
        }
    )
    loss = module.loss(samples, {}, 0)
    mask = samples.completion_mask.float()
    weights = truncated_is_weights(old, rollout, 1.5)
    assert (weights[mask.bool()] == 1.5).any() and (weights[mask.bool()] < 1).any()
    surrogate = clipped_surrogate(logprobs, old, samples.advantages.unsqueeze(1), module.update.clip_range)
    expected = masked_sum(surrogate * weights, mask, module.update.logprob_reduction).sum()
    expected = expected + module.value_term(values, samples.old_values, samples.targets)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
