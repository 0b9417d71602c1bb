"""Every loss term of ``lit_marl/losses.py`` against a computation by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lit_marl.losses import (
    bradley_terry,
    clip_fraction,
    clipped_surrogate,
    explained_variance,
    joint_dpo,
    k3_kl,
    masked_sum,
    nll,
    reinforce,
    value_loss,
)

T = torch.tensor


def test_masked_sum_and_mean_over_each_rows_tokens():
    per_token = T([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]])
    mask = T([[1, 1, 0], [0, 0, 0]])
    assert masked_sum(per_token, mask).tolist() == [3.0, 0.0]
    assert masked_sum(per_token, mask, "mean").tolist() == [1.5, 0.0]  # a row without tokens: 0


def test_reinforce_is_minus_advantage_times_logprob():
    assert reinforce(T([-0.5, -2.0]), T([2.0, -1.0])).tolist() == [1.0, -2.0]


def test_clipped_surrogate_takes_the_pessimistic_term():
    old = T([0.0, 0.0, 0.0, 0.0])
    new = T([math.log(1.5), math.log(1.5), math.log(0.5), math.log(1.1)])
    adv = T([1.0, -1.0, -1.0, 2.0])
    out = clipped_surrogate(new, old, adv, 0.2)
    # ratio 1.5, A > 0: min(1.5, 1.2) = 1.2; A < 0: min(-1.5, -1.2) = -1.5 (no clipping of a loss increase)
    # ratio 0.5, A < 0: min(-0.5, -0.8) = -0.8; ratio 1.1 inside the range: 2.2
    torch.testing.assert_close(out, T([-1.2, 1.5, 0.8, -2.2]))
    # at ratio 1 it is the ratio-free term
    torch.testing.assert_close(clipped_surrogate(old, old, adv, 0.2), -adv)


def test_k3_kl_estimator():
    d = T([0.0, 1.0, -1.0])
    torch.testing.assert_close(k3_kl(d), T([0.0, math.e - 2.0, math.exp(-1.0)]))
    assert (k3_kl(torch.linspace(-5, 5, 11)) >= 0).all()
    # unbiased: the mean over samples of p of k3(log q - log p) is KL(p || q)
    p, q = T([0.7, 0.3]), T([0.4, 0.6])
    expected = float((p * (p / q).log()).sum())
    assert float((p * k3_kl(q.log() - p.log())).sum()) == pytest.approx(expected, rel=1e-6)


def test_the_ratio_is_exp_of_the_log_ratio_held_at_20_as_verl():
    """A log-ratio of 100 overflows float32's exp to inf (an inf loss, a NaN gradient); held at +-20
    first (veRL's clamp of ``negative_approx_kl``) the loss and its gradient stay finite, with or
    without the dual clip. Inside +-20 the ratio is exp's, bit for bit."""
    for dual_clip in (None, 3.0):
        new = T([100.0, 100.0, -100.0, -100.0, 0.3]).requires_grad_()
        loss = clipped_surrogate(new, torch.zeros(5), T([1.0, -1.0, 1.0, -1.0, 1.0]), 0.2, dual_clip)
        loss.sum().backward()
        assert torch.isfinite(loss).all(), loss
        assert torch.isfinite(new.grad).all(), new.grad
    d = torch.linspace(-20, 20, 4001)  # clip_range 1e9 leaves every ratio below e^20 unclipped: the loss is -ratio
    assert torch.equal(-clipped_surrogate(d, torch.zeros_like(d), torch.ones_like(d), 1e9), d.exp())


def test_k3_holds_its_log_ratio_at_20_as_verl():
    """veRL's ``low_var_kl`` (its ``k3`` too) clamps the log-ratio at +-20 before exp, capped or not:
    a log-ratio of 100 gives a finite estimate and gradient; inside +-20 the estimate is exp(d) - d - 1."""
    for clamp in (None, 10.0):
        d = T([100.0, -100.0]).requires_grad_()
        kl = k3_kl(d, clamp)
        kl.sum().backward()
        assert torch.isfinite(kl).all() and torch.isfinite(d.grad).all(), (kl, d.grad)
    d = torch.linspace(-20, 20, 4001)
    assert torch.equal(k3_kl(d), d.exp() - d - 1)
    assert float(k3_kl(T([100.0]))) == float(k3_kl(T([20.0])))


def test_clip_fraction_counts_ratios_outside_the_range():
    log_ratio = T([0.0, math.log(1.25), math.log(0.75), math.log(1.19)])
    assert clip_fraction(log_ratio, 0.2).tolist() == [0.0, 1.0, 1.0, 0.0]


def test_value_loss_mean_and_clipping():
    # unclipped: mean of (V - y)^2 over the mask
    assert float(value_loss(T([1.0, 3.0, 9.0]), T([0.0, 0.0, 0.0]), T([2.0, 1.0, 0.0]), T([1, 1, 0]), None)) == 2.5
    # clipped: V_clip = 0.5 + clip(1.0 - 0.5, 0.2) = 0.7; max((1 - 2)^2, (0.7 - 2)^2) = 1.69
    assert float(value_loss(T([1.0]), T([0.5]), T([2.0]), T([1]), 0.2)) == pytest.approx(1.69)


def test_nll_sums_the_masked_tokens():
    assert float(nll(T([[-1.0, -2.0], [-3.0, -4.0]]), T([[1, 0], [1, 1]]))) == 8.0


def test_explained_variance():
    y = T([1.0, 2.0, 3.0, 4.0])
    assert float(explained_variance(y, y)) == 1.0
    assert float(explained_variance(y, torch.full_like(y, 2.5))) == 0.0  # a constant critic
    # 1 - Var(y - v) / Var(y), population variances: residuals [1, 0, 1, 0] -> 0.25 / 1.25
    assert float(explained_variance(y, T([0.0, 2.0, 2.0, 4.0]))) == pytest.approx(1 - 0.25 / 1.25)


def test_token_entropy_and_logprobs_by_hand():
    from lit_marl.logprobs import token_entropy, token_logprobs

    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30]]]))  # [1, 2, 3]
    entropy = token_entropy(logits)
    assert entropy[0, 0] == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    assert entropy[0, 1] == pytest.approx(0.0, abs=1e-6)  # a certain next token
    assert token_logprobs(logits, torch.tensor([[1, 0]])).tolist()[0] == pytest.approx([math.log(0.25), 0.0])


def test_joint_dpo_by_hand_and_gradient_only_through_the_agents_own_delta():
    # two agents, two pairs: D = [[0.5, -1.0], [0.25, 2.0]], beta 0.1
    deltas = T([[0.5, -1.0], [0.25, 2.0]], requires_grad=True)
    loss = joint_dpo(deltas, agent=0, beta=0.1)
    by_hand = [-math.log(1 / (1 + math.exp(-0.1 * (0.5 + 0.25)))), -math.log(1 / (1 + math.exp(-0.1 * (-1.0 + 2.0))))]
    assert loss.tolist() == pytest.approx(by_hand, rel=1e-6)
    loss.sum().backward()
    # d/dD_0 of -log sigmoid(b z) = -b * (1 - sigmoid(b z)); agent 1's row gets no gradient (stop-gradient)
    z = [0.75, 1.0]
    assert deltas.grad[0].tolist() == pytest.approx([-0.1 * (1 - 1 / (1 + math.exp(-0.1 * v))) for v in z], rel=1e-6)
    assert deltas.grad[1].tolist() == [0.0, 0.0]


def test_joint_dpo_with_one_agent_is_dpo():
    deltas = T([[0.3, -0.7]])
    assert joint_dpo(deltas, 0, beta=2.0).tolist() == pytest.approx(
        [math.log(1 + math.exp(-0.6)), math.log(1 + math.exp(1.4))], rel=1e-6
    )


def test_bradley_terry_by_hand():
    out = bradley_terry(T([1.0, 0.0, -2.0]), T([0.0, 0.0, 1.0]))
    assert out.tolist() == pytest.approx([math.log(1 + math.exp(-1)), math.log(2), math.log(1 + math.exp(3))], rel=1e-6)
