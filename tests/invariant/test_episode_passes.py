"""The passes of an episode update give what the plain passes over whole rows give: PPO's behaviour
log-probs and old values come from one forward of the policy per pass (two before: one for each),
each pass trimmed of its common left padding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lit_marl.algorithms import GRPO, PPO
from lit_marl.envs import make_env
from lit_marl.logprobs import final_hidden_states, masked_logprobs
from lit_marl.rollout.episode import EpisodeSettings, run_episodes

TASKS = [{"length": n, "key_room": 2} for n in (3, 4, 5, 6)]


def _episodes(module):
    torch.manual_seed(0)
    settings = EpisodeSettings(max_turns=3, max_new_tokens=6, temperature=1.5)
    (batch,) = run_episodes([module.agents[0]], TASKS, make_env("corridor"), settings)
    ids, att, own = batch.input_ids.clone(), batch.attention_mask.clone(), batch.loss_mask.clone()
    for row, cut in enumerate((0, 7, 20, 33)):  # rows of different lengths: left padding, some common to a pass
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
    module = PPO(model="tiny-random", critic=critic, forward_batch_size=2)
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
    module = GRPO(model="tiny-random", forward_batch_size=2)
    module.configure_model()
    batch = _episodes(module)
    calls = _counted(module.model_of(0))
    logprobs, values = module.behaviour(batch, 0)
    assert values is None and len(calls) == 2
    with torch.no_grad():
        expected = masked_logprobs(module.model_of(0), batch.input_ids, batch.attention_mask, batch.loss_mask)[0]
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
