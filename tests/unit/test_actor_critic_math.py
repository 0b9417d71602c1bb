"""TD targets, advantages and value-loss clipping of the actor-critic family, with numbers by hand."""

from __future__ import annotations

import pytest
import torch

from lit_marl.losses import value_loss
from lit_marl.parallel.collectives import z_score_per_group
from lit_marl.returns import td_advantages, td_targets

T = torch.tensor


NONE = -1  # next_rows of an episode's last turn


def test_one_turn_has_no_bootstrap():
    for gamma in (0.9, 1.0):
        y = td_targets(T([1.0]), T([0.4]), T([NONE]), gamma)
        assert torch.allclose(y, T([1.0]))
        assert torch.allclose(td_advantages(y, T([0.4])), T([0.6]))


@pytest.mark.parametrize("gamma, y0", [(0.9, 0.5 + 0.9 * 0.6), (1.0, 1.1)])
def test_two_turns_bootstrap_from_the_next_state(gamma, y0):
    values = T([0.2, 0.6])  # rows: turn 0, turn 1 of one episode
    y = td_targets(T([0.5, 1.0]), values, T([1, NONE]), gamma)
    assert torch.allclose(y, T([y0, 1.0]))
    assert torch.allclose(td_advantages(y, values), T([y0 - 0.2, 0.4]))


@pytest.mark.parametrize("gamma", [0.9, 1.0])
def test_three_turns_full_and_terminated_early(gamma):
    # rows as the tree lays them out, turn by turn: episode a (3 turns) and episode b, which ended
    # after its turn 1 (early termination); b's value of 9.0 belongs to nobody's next state
    #          a0   b0   a1   b1   a2
    rewards = T([1.0, 0.0, 0.0, 2.0, 2.0])
    values = T([0.3, 1.0, 0.7, 0.5, 1.1])
    next_rows = T([2, 3, 4, NONE, NONE])
    y = td_targets(rewards, values, next_rows, gamma)
    expected = T([1 + gamma * 0.7, gamma * 0.5, gamma * 1.1, 2.0, 2.0])
    assert torch.allclose(y, expected)  # no bootstrap after the last played turn
    assert torch.allclose(td_advantages(y, values), expected - values)


def test_advantages_z_scored_per_turn_group():
    y = T([1.0, 3.0, 2.0])
    v = torch.zeros(3)
    adv = z_score_per_group(td_advantages(y, v), T([0, 0, 1]))
    assert torch.allclose(adv[:2], T([-1.0, 1.0]), atol=1e-5)  # turn 0: mean 2, std 1
    assert adv[2] == 2.0  # alone at turn 1: too small to normalize, keeps its raw advantage (CoMLRL)


def test_value_loss_clipping():
    # moving 1.0 away from old 0.5 toward target 2.0: clipped value 0.7 has the larger error
    assert torch.allclose(value_loss(T([1.0]), T([0.5]), T([2.0]), T([1]), 0.2), T(1.69))
    assert torch.allclose(value_loss(T([1.0]), T([0.5]), T([2.0]), T([1]), None), T(1.0))
    # already close to the target: the unclipped error is small, the clipped one larger, max wins
    assert torch.allclose(value_loss(T([1.9]), T([1.5]), T([2.0]), T([1]), 0.2), T(0.09))
    # the mask averages over live turns only
    assert torch.allclose(value_loss(T([1.0, 7.0]), T([1.0, 7.0]), T([2.0, 0.0]), T([1, 0]), 0.2), T(1.0))


def test_next_turn_rows_follow_the_node_links():
    from lit_marl.returns import next_turn_rows

    # rows of nodes 1, 0, 3, 2: node 1 led to node 3 (row 2), node 0 to node 2 (row 3), the rest ended
    rows = next_turn_rows(T([1, 0, 3, 2]).long(), T([3, 2, -1, -1]).long())
    assert rows.tolist() == [2, 3, -1, -1]
    with pytest.raises(ValueError, match="num_generations=1"):  # two rows at one node: no single next state
        next_turn_rows(T([0, 0, 1]).long(), T([1, 1, -1]).long())
