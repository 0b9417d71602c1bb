"""The guide's math (veRL's, which the guide's code runs unchanged), exactly where lit_marl follows it.

The pinned numbers are veRL's own functions on fixed inputs, both in tests/fixtures/verl_guide_math.json,
written by ``python scripts/pin_verl_math.py <guide repo>/meow_tea_train/verl/trainer/ppo/core_algos.py``."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from helpers import REPO_ROOT, corridor_data, make_trainer
from lit_marl import ConfigError
from lit_marl.algorithms import GRPO, PPO
from lit_marl.losses import clipped_surrogate, k3_kl, value_loss
from lit_marl.returns import episode_advantages, group_advantages

VERL = json.loads((REPO_ROOT / "tests" / "fixtures" / "verl_guide_math.json").read_text())
X = {name: torch.tensor(values) for name, values in VERL["inputs"].items()}
T = torch.tensor


def test_grpo_on_episodes_is_magrpos_and_verls_formula():
    """One turn, groups of 4 (consecutive rows): the episode family, the tree family (MAGRPO with one
    agent and one turn) and veRL's GRPO give the same advantages: (r - mean) / sample std, a tie 0."""
    scores, verl = X["group_scores"], T(VERL["grpo_advantages"])
    episodes = episode_advantages(scores.view(-1, 1), torch.ones(16, 1, dtype=torch.bool), 4, "grpo", True)
    tree = group_advantages(scores.view(4, 4), "mean", normalize=True).reshape(-1)
    torch.testing.assert_close(episodes.view(-1), verl, atol=1e-5, rtol=0)
    torch.testing.assert_close(tree, verl, atol=1e-5, rtol=0)
    # by hand, group 0: (1 - 0.5) / std(1, 0, 0, 1) with the sample std sqrt(1/3)
    assert abs(float(episodes[0, 0]) - 0.5 / (1 / 3) ** 0.5) < 1e-6


def test_dual_clip_caps_negative_advantage_tokens_at_c():
    old, new, adv, mask = X["old_logprobs"], X["logprobs"], X["advantages"], X["mask"]
    per_token = clipped_surrogate(new, old, adv, 0.2, dual_clip=3.0)
    token_mean = float((per_token * mask).sum() / mask.sum())
    assert abs(token_mean - VERL["dual_clip_policy_loss"]) < 1e-5
    # by hand: token (0, 2) has A = -2 and ratio e^1.7 = 5.47 > 3: PPO's -min(rA, clip(r)A) = 10.95,
    # dual clip caps it at -3A = 6; so (1, 1): A = -0.8, ratio e^1.8, 2.4 and (1, 2): A = -1.2, ratio
    # e^1.5, 3.6; a positive advantage or a ratio below c is left as PPO has it
    plain = clipped_surrogate(new, old, adv, 0.2)
    assert abs(float(plain[0, 2]) - 2 * torch.e**1.7) < 1e-4
    capped = torch.zeros_like(mask, dtype=torch.bool)
    capped[0, 2] = capped[1, 1] = capped[1, 2] = True
    torch.testing.assert_close(per_token[capped], T([6.0, 2.4, 3.6]))
    assert torch.equal(per_token[~capped], plain[~capped])
    # a capped token pushes no more: its gradient is 0
    new = new.clone().requires_grad_(True)
    clipped_surrogate(new, old, adv, 0.2, dual_clip=3.0)[0, 2].backward()
    assert float(new.grad[0, 2]) == 0.0


def test_kl_clamp_is_verls_low_var_kl_and_off_by_default():
    log_ratio = X["ref_logprobs"] - X["logprobs"]
    torch.testing.assert_close(k3_kl(log_ratio, clamp=10.0), T(VERL["low_var_kl"]), atol=1e-5, rtol=0)
    exact = k3_kl(log_ratio)  # not capped; its log-ratio held at +-20 as veRL's (29.5 and -29.8 here)
    assert float(exact[0, 3]) == pytest.approx(torch.e**20 - 21) and float(exact[0, 0]) == pytest.approx(19.0)
    assert float(exact[1, 1]) == pytest.approx(14.3 + torch.e**-14.3 - 1)
    inside = exact < 10  # where the estimate is below the cap, both agree
    assert torch.allclose(exact[inside], k3_kl(log_ratio, clamp=10.0)[inside])


def test_value_loss_is_verls():
    loss = 0.5 * value_loss(X["values_new"], X["values_old"], X["returns"], X["mask"], 0.5, "mean")
    assert abs(float(loss) - VERL["value_loss"]) < 1e-5


def test_settings_refuse_what_they_cannot_mean():
    with pytest.raises(ConfigError, match=r"model\.update\.dual_clip=1\.0: must be > 1"):
        GRPO(model="tiny-random", update={"dual_clip": 1.0})
    with pytest.raises(ConfigError, match=r"model\.kl\.clamp=10\.0 caps the KL loss term.*kl\.mode: loss"):
        GRPO(model="tiny-random", kl={"coef": 0.01, "mode": "reward", "clamp": 10.0})


class SGDRecordingPPO(PPO):
    """Plain SGD, lr 1, over the policy and the value head: an update is minus the gradient; keeps the
    step's samples, counts and the weights before it."""

    def configure_optimizers(self):
        params = list(self.agents[0].trainable_parameters()) + list(self.value_heads[0].parameters())
        return [torch.optim.SGD(params, lr=1.0)]

    def update_agent(self, index, samples, loss_fn, count=None, **kwargs):
        self.seen = (samples, count, {n: p.detach().clone() for n, p in self.named_parameters()})
        return super().update_agent(index, samples, loss_fn, count=count, **kwargs)


@pytest.mark.parametrize("gae", ["token", "turn"])
def test_value_loss_coef_weighs_a_mean_over_value_positions_in_both_gae_modes(tmp_path, gae):
    """The critic's update is value_loss_coef x 0.5 x the mean squared error over the value positions
    (every action token, or each turn's first), over micro-batches of one episode: under turn-level
    GAE the value loss is not divided by the number of action tokens."""
    L.seed_everything(0)
    module = SGDRecordingPPO(
        model="tiny-random",
        advantage={"gae": gae},
        update={"ppo_epochs": 1},
        critic={"value_loss_coef": 0.7},
        max_grad_norm=0.0,
        memory={"forward_batch_size": 1},
    )
    sampling = {"max_new_tokens": 6, "temperature": 1.5}
    data = corridor_data(tasks_per_step=3, num_generations=1, max_turns=3, sampling=sampling, reward_density="dense")
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False).fit(module, datamodule=data)
    samples, _, before = module.seen
    positions, tokens = float(samples.value_mask.sum()), float(samples.loss_mask.sum())
    assert (positions < tokens) == (gae == "turn")  # turn level: one value position per turn
    head = dict(module.value_heads[0].named_parameters())
    after = {n: p.detach().clone() for n, p in head.items()}
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(before[name])
    values = module.forward(samples, 0)[1]
    clip = module.critic.value_clip_range
    mse = value_loss(values, samples.old_values, samples.returns, samples.value_mask, clip, "mean")
    grads = torch.autograd.grad(0.7 * 0.5 * mse, list(head.values()))
    for (name, _), grad in zip(head.items(), grads):
        assert grad.abs().sum() > 0, "no value gradient: the check is void"
        torch.testing.assert_close(before[f"value_heads.0.{name}"] - after[name], grad, atol=1e-6, rtol=1e-4)


def test_a_critic_is_clipped_apart_from_its_policy():
    """veRL clips the actor's and the critic's gradient norms each on its own: a large value error
    does not shrink the policy's step (one optimizer holds both here, as param groups)."""
    from lit_marl.algorithms.updates import clipped_apart

    module = PPO(model="tiny-random", critic={"kind": "head"})
    module.configure_model()
    policy, critic = clipped_apart(module.configure_optimizers()[0])
    assert {id(p) for p in critic} == {id(p) for p in module.value_heads[0].parameters()}
    assert {id(p) for p in policy} == {id(p) for p in module.agents[0].trainable_parameters()}


def test_tempered_logprobs_score_every_update_under_the_sampling_distribution(tmp_path):
    """``model.update.tempered_logprobs``: veRL's actor divides the logits by the rollout temperature
    before its log-softmax (old, new and reference log-probs alike); so do GRPO's forward and its
    reference pass here, at the data's sampling temperature, and only with the setting."""
    from lit_marl.algorithms.settings import logit_temperature
    from lit_marl.logprobs import sequence_logprobs, token_logprobs

    logits, targets = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    verl = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)  # logprobs_from_logits
    torch.testing.assert_close(token_logprobs(logits, targets, 0.7), verl)
    data = corridor_data(
        tasks_per_step=2, num_generations=2, max_turns=2, sampling={"max_new_tokens": 4, "temperature": 0.7}
    )
    L.seed_everything(0)
    module = GRPO(model="tiny-random", kl={"coef": 0.1}, update={"tempered_logprobs": True})
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False).fit(module, datamodule=data)
    assert module.logit_temperature == 0.7  # set from the data's sampling settings in setup
    assert logit_temperature(GRPO().update, data.rollout_settings) == 1.0  # off by default
    (batch,) = data.rollout(list(module.agents), data.train_tasks[:1], greedy=False)
    model = module.agents[0].model
    with torch.no_grad():
        ours = module.forward(batch)[0]
        module.logit_temperature = 1.0
        untempered = module.forward(batch)[0]
        ids, mask = batch.input_ids, batch.attention_mask
        full = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        by_hand = torch.log_softmax(full[:, :-1].float() / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = batch.loss_mask[:, 1:].bool()
    torch.testing.assert_close(ours[:, 1:][keep], by_hand[keep], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ours[:, 1:][keep], untempered[:, 1:][keep], atol=1e-3)
    torch.testing.assert_close(
        untempered[:, 1:][keep], sequence_logprobs(model, ids, mask)[:, 1:][keep], atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ConfigError, match="tempered_logprobs with model.update.rollout_is_cap"):
        GRPO(update={"tempered_logprobs": True, "rollout_is_cap": 2.0})
