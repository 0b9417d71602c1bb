"""Hand-computed checks of the advantage and return math (no models)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_marl.returns import cross_agent_returns, group_advantages

# group 0: mean 3, max 6, sum 12; group 1: all equal
RETURNS = torch.tensor([[1.0, 2.0, 3.0, 6.0], [4.0, 4.0, 4.0, 4.0]])


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=1e-5, rtol=1e-5)


def test_mean_baseline():
    close(group_advantages(RETURNS, "mean"), [[-2.0, -1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]])


def test_mean_is_the_default():
    close(group_advantages(RETURNS), [[-2.0, -1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]])


def test_raw_baseline_is_a_copy():
    adv = group_advantages(RETURNS, "raw")
    close(adv, RETURNS)
    adv[0, 0] = 100.0
    assert RETURNS[0, 0] == 1.0, "raw advantages must not alias the returns"


def test_max_baseline():
    close(group_advantages(RETURNS, "max"), [[-5.0, -4.0, -3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_loo_baseline():
    # r - mean(others): 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3
    close(group_advantages(RETURNS, "rloo"), [[-8 / 3, -4 / 3, 0.0, 4.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("size", [2, 3, 5])
def test_loo_equals_scaled_mean(size):
    returns = torch.randn(4, size, generator=torch.Generator().manual_seed(size))
    expected = size / (size - 1) * (returns - returns.mean(dim=1, keepdim=True))
    close(group_advantages(returns, "rloo"), expected)


def test_loo_needs_two():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.tensor([[1.0], [2.0]]), "rloo")


def test_scale_by_std():
    std = math.sqrt(14 / 3)  # unbiased std of [1, 2, 3, 6]
    adv = group_advantages(RETURNS, "mean", normalize=True)
    close(adv[0], [-2 / std, -1 / std, 0.0, 3 / std])
    # equal rewards: advantage exactly 0, not nan/inf
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[1], torch.zeros(4))


def test_scale_by_std_single_sample_groups_are_finite():
    adv = group_advantages(torch.tensor([[5.0], [7.0]]), "mean", normalize=True)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv, torch.zeros(2, 1))


def test_scale_by_rms_with_max_baseline():
    rms = math.sqrt((25 + 16 + 9) / 3)  # the advantages' spread around the best return
    close(group_advantages(RETURNS, "max", normalize=True)[0], [-5 / rms, -4 / rms, -3 / rms, 0.0])


def test_normalized_loo_is_normalized_mean():
    """A baseline's constant factor G/(G-1) is what normalization removes."""
    close(group_advantages(RETURNS, "rloo", normalize=True), group_advantages(RETURNS, "mean", normalize=True))


@pytest.mark.parametrize("returns", [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0 + 1e-4], [3.0, 3.0001, 2.9999, 3.0]])
@pytest.mark.parametrize("mode", ["raw", "mean", "max", "rloo"])
def test_normalizing_a_tie_never_makes_a_huge_signal(returns, mode):
    """Bug: raw (MAREINFORCE) advantages of siblings tied at a non-zero return were divided by the
    std floor (1e-3): 1000 per response. Every normalized advantage is at most sqrt(G-1)."""
    adv = group_advantages(torch.tensor([returns]), mode, normalize=True, std_floor=1e-3)
    assert adv.abs().max() <= math.sqrt(3) + 1e-5
    if mode == "raw" and len(set(returns)) == 1:  # an exact tie keeps the return's sign, at unit size
        close(adv, [[math.sqrt(3 / 4)] * 4])
    if mode != "raw" and len(set(returns)) == 1:
        assert torch.equal(adv, torch.zeros(1, 4))


def test_raw_normalization_scales_by_the_returns_spread_around_zero():
    returns = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    rms = math.sqrt((1 + 4 + 9 + 36) / 3)
    close(group_advantages(returns, "raw", normalize=True), returns / rms)


@pytest.mark.parametrize("mode", ["raw", "mean", "max", "rloo"])
def test_zscore_form_is_comlrls(mode):
    """CoMLRL: (A - mean A) / std_population(A).clamp(1e-6); every mode becomes mean's z-score."""
    adv = group_advantages(RETURNS, mode, normalize=True, std_floor=1e-6, form="zscore")
    centred = RETURNS[0] - 3.0
    close(adv[0], centred / centred.pow(2).mean().sqrt())
    assert torch.equal(adv[1], torch.zeros(4))  # a tie: 0 / floor
    near = group_advantages(
        torch.tensor([[1.0, 1.0 + 1e-4]], dtype=torch.float64), mode, normalize=True, std_floor=1e-6, form="zscore"
    )
    close(near, [[-1.0, 1.0]])  # CoMLRL amplifies a near-tie to a unit signal (documented)


@pytest.mark.parametrize("form", ["rms", "zscore"])
def test_both_forms_keep_a_group_of_one(form):
    close(group_advantages(torch.tensor([[5.0], [-2.0]]), "raw", normalize=True, form=form), [[5.0], [-2.0]])


def test_bad_baseline():
    with pytest.raises(ValueError, match="advantage_mode='median'"):
        group_advantages(RETURNS, "median")


@pytest.mark.parametrize("shape", [(4,), (2, 2, 2)])
def test_wrong_dims(shape):
    with pytest.raises(ValueError, match="num_groups, G"):
        group_advantages(torch.zeros(shape))


def test_cross_two_agents_two_samples():
    # joint[k0, k1]: agent 0 row means, agent 1 column means
    joint = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    close(cross_agent_returns(joint), [[1.5, 4.0], [2.0, 3.5]])


def test_cross_two_agents_three_samples():
    joint = torch.tensor([[1.0, 0.0, 2.0], [4.0, 4.0, 4.0], [0.0, 9.0, 0.0]])
    close(cross_agent_returns(joint), [[1.0, 4.0, 3.0], [5 / 3, 13 / 3, 2.0]])


def test_cross_three_agents():
    joint = torch.arange(8.0).view(2, 2, 2)  # joint[a, b, c] = 4a + 2b + c
    expected = [
        [1.5, 5.5],  # a=0: {0,1,2,3}; a=1: {4,5,6,7}
        [2.5, 4.5],  # b=0: {0,1,4,5}; b=1: {2,3,6,7}
        [3.0, 4.0],  # c=0: {0,2,4,6}; c=1: {1,3,5,7}
    ]
    out = cross_agent_returns(joint)
    assert out.shape == (3, 2)
    close(out, expected)


def test_cross_one_agent_is_identity():
    joint = torch.tensor([1.0, 2.0, 3.0])
    out = cross_agent_returns(joint)
    assert out.shape == (1, 3)
    close(out, [[1.0, 2.0, 3.0]])
