"""TD targets, advantages and value-loss clipping of the actor-critic family, with numbers by hand."""

from __future__ import annotations

import pytest
import torch

from lit_marl.returns import td_advantages, td_targets, value_loss

T = torch.tensor


def test_one_turn_has_no_bootstrap():
    for gamma in (0.9, 1.0):
        y = td_targets(T([[1.0]]), T([[0.4]]), T([[1]]), gamma)
        assert torch.allclose(y, T([[1.0]]))
        assert torch.allclose(td_advantages(y, T([[0.4]]), T([[1]])), T([[0.6]]))


@pytest.mark.parametrize("gamma, y0", [(0.9, 0.5 + 0.9 * 0.6), (1.0, 1.1)])
def test_two_turns_bootstrap_from_the_next_state(gamma, y0):
    values = T([[0.2, 0.6]])
    y = td_targets(T([[0.5, 1.0]]), values, T([[1, 1]]), gamma)
    assert torch.allclose(y, T([[y0, 1.0]]))
    assert torch.allclose(td_advantages(y, values, T([[1, 1]])), T([[y0 - 0.2, 0.4]]))


@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_three_turns_full_and_terminated_early(gamma):
    rewards = T([[1.0, 0.0, 2.0], [0.0, 2.0, 5.0]])
    values = T([[0.3, 0.7, 1.1], [1.0, 0.5, 9.0]])
    alive = T([[1, 1, 1], [1, 1, 0]])  # the second episode ended (early termination) after turn 1
    y = td_targets(rewards, values, alive, gamma)
    expected = T([[1 + gamma * 0.7, gamma * 1.1, 2.0], [gamma * 0.5, 2.0, 0.0]])
    assert torch.allclose(y, expected)  # no bootstrap after the last played turn, nothing after it
    adv = td_advantages(y, values, alive)
    assert torch.allclose(adv, expected - values * alive)


def test_advantages_z_scored_per_turn_over_live_episodes():
    y = T([[1.0, 2.0], [3.0, 0.0]])
    v = torch.zeros(2, 2)
    alive = T([[1, 1], [1, 0]])
    adv = td_advantages(y, v, alive, normalize=True)
    assert torch.allclose(adv[:, 0], T([-1.0, 1.0]), atol=1e-5)  # mean 2, std 1
    assert adv[0, 1] == 0 and adv[1, 1] == 0  # alone at turn 1: centred to 0; ended: 0


def test_value_loss_clipping():
    # moving 1.0 away from old 0.5 toward target 2.0: clipped value 0.7 has the larger error
    assert torch.allclose(value_loss(T([1.0]), T([0.5]), T([2.0]), T([1]), 0.2), T(1.69))
    assert torch.allclose(value_loss(T([1.0]), T([0.5]), T([2.0]), T([1]), None), T(1.0))
    # already close to the target: the unclipped error is small, the clipped one larger, max wins
    assert torch.allclose(value_loss(T([1.9]), T([1.5]), T([2.0]), T([1]), 0.2), T(0.09))
    # the mask averages over live turns only
    assert torch.allclose(value_loss(T([1.0, 7.0]), T([1.0, 7.0]), T([2.0, 0.0]), T([1, 0]), 0.2), T(1.0))
