"""The passes of an episode update give what the plain passes over whole rows give: PPO's behaviour
log-probs and old values come from one forward of the policy per pass (two before: one for each),
episodes of similar length share a pass, each pass trimmed of its common left padding."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lit_marl.algorithms import GRPO, PPO
from lit_marl.envs import make_env
from lit_marl.generation import Sampling
from lit_marl.logprobs import final_hidden_states, masked_logprobs
from lit_marl.rollout.batch import length_passes, pass_rows
from lit_marl.rollout.episode import EpisodeSettings, run_episodes

TASKS = [{"length": n, "key_room": 2} for n in (3, 4, 5, 6)]


def _episodes(module):
    torch.manual_seed(0)
    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=6, temperature=1.5))
    (batch,) = run_episodes([module.agents[0]], TASKS, make_env("corridor"), settings)
    ids, att, own = batch.input_ids.clone(), batch.attention_mask.clone(), batch.loss_mask.clone()
    for row, cut in enumerate((20, 0, 33, 7)):  # rows of different lengths: left padding, some common to a pass
        ids[row, :cut], att[row, :cut], own[row, :cut] = module.agents[0].pad_token_id, 0, 0
    return replace(batch, input_ids=ids, attention_mask=att, loss_mask=own)


def _counted(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def _whole_rows(module, batch):
    """The behaviour log-probs and values as the plain passes give them: every row whole, a
    log-prob pass and a value pass (the LM head on no position) of the policy."""
    model, ids, att = module.model_of(0), batch.input_ids, batch.attention_mask
    with torch.no_grad():
        logprobs = masked_logprobs(model, ids, att, batch.loss_mask)[0]
        if module.critic_backbones is None:
            hidden = masked_logprobs(model, ids, att, torch.zeros_like(batch.loss_mask), hidden=True)[1]
        else:
            hidden = final_hidden_states(module.critic_backbones[0], ids, att)
        values = F.pad(module.value_heads[0](hidden[:, :-1]), (1, 0))
    return logprobs, values


@pytest.mark.parametrize("critic", ["head", "model"])
def test_ppo_behaviour_is_one_policy_forward_per_pass(critic):
    module = PPO(model="tiny-random", critic={"kind": critic}, memory={"forward_batch_size": 2})
    module.configure_model()
    batch = _episodes(module)
    policy = _counted(module.model_of(0))
    critic_calls = _counted(module.critic_backbones[0]) if critic == "model" else []
    logprobs, values = module.behaviour(batch, 0)
    passes = len(module.micro_batches(batch))
    assert passes == 2
    assert len(policy) == passes  # the value head reads the same pass's hidden states
    assert len(critic_calls) == (passes if critic == "model" else 0)
    expected_logprobs, expected_values = _whole_rows(module, batch)
    own, real = batch.loss_mask.bool(), batch.attention_mask.bool()
    torch.testing.assert_close(logprobs[own], expected_logprobs[own], rtol=0, atol=1e-5)
    assert not logprobs[~own].any()
    real[torch.arange(len(real)), real.int().argmax(-1)] = False  # nor at a row's first token (nothing before it)
    torch.testing.assert_close(values[real], expected_values[real], rtol=0, atol=1e-5)


def test_group_algorithms_take_one_pass_and_no_values():
    module = GRPO(model="tiny-random", memory={"forward_batch_size": 2})
    module.configure_model()
    batch = _episodes(module)
    calls = _counted(module.model_of(0))
    logprobs, values = module.behaviour(batch, 0)
    assert values is None and len(calls) == 2
    with torch.no_grad():
        expected = masked_logprobs(module.model_of(0), batch.input_ids, batch.attention_mask, batch.loss_mask)[0]
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)


def test_length_passes_put_rows_of_similar_length_together():
    lengths = torch.tensor([604, 280, 535, 350])
    passes = length_passes(lengths, 2048, None)
    assert sorted(torch.cat(passes).tolist()) == [0, 1, 2, 3]  # every row once
    assert [p.tolist() for p in passes] == [[0, 2], [3, 1]]  # 2 x 604 + 2 x 350 padded tokens
    in_order = pass_rows(SimpleNamespace(input_ids=torch.zeros(4, 604)), 2048, None)  # cut in order, as before
    padded = lambda cut: sum(len(p) * int(lengths[p].max()) for p in cut)  # noqa: E731
    assert padded(passes) == 1908 < padded(in_order) == 3 * 604 + 350
    assert [p.tolist() for p in length_passes(lengths, 2048, 1)] == [[0], [2], [3], [1]]
    assert [p.tolist() for p in length_passes(lengths, None, None)] == [[0, 2, 3, 1]]
    assert [p.tolist() for p in length_passes(torch.tensor([900, 700]), 512, None)] == [[0], [1]]  # each alone


def _gradients(module, samples) -> dict:
    """The gradient of PPO's loss over ``samples``, summed over the update's passes as the step sums it."""
    module.zero_grad(set_to_none=True)
    counts = samples.loss_counts()
    for rows in module.micro_batches(samples):
        terms = module.loss(samples.select(rows), dict.fromkeys(("approx_kl", "clip_frac", "tokens"), 0.0), 0)
        sum(term / n for term, n in zip(terms, counts)).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_passes_of_similar_length_give_the_gradient_of_one_pass():
    """Episodes cut into passes by length give the gradient of one pass over them all."""
    module = PPO(model="tiny-random", memory={"forward_batch_size": 2, "forward_token_budget": None})
    module.configure_model()
    batch = _episodes(module)
    rewards = torch.linspace(-1, 1, batch.end_positions.numel()).view(batch.end_positions.shape)
    samples = module.prepare(replace(batch, rewards=rewards, rollout_logprobs=None), 0)
    passes = module.micro_batches(samples)
    assert [p.tolist() for p in passes] == [[1, 3], [0, 2]]  # the rows, longest first
    cut = _gradients(module, samples)
    module.memory = replace(module.memory, forward_batch_size=None)
    assert len(module.micro_batches(samples)) == 1
    whole = _gradients(module, samples)
    assert whole.keys() == cut.keys() and any(n.startswith("value_heads") for n in whole)
    for name in whole:
        torch.testing.assert_close(cut[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
