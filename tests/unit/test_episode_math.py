"""Multi-turn episode math with hand-computed numbers: reward placement, GAE over masked tokens,
turn-level GAE, returns-to-go, GRPO/RLOO group baselines over episodes."""

from __future__ import annotations

import pytest
import torch

from lit_marl.returns import (
    anchor_groups,
    episode_advantages,
    episode_group_advantages,
    returns_to_go,
    step_group_advantages,
    step_reward,
    token_gae,
    turn_gae,
)

T = torch.tensor


def test_token_gae_skips_observation_tokens():
    # prompt, 2 action tokens (turn 1 ends with reward 0.5), 2 observation tokens, 2 action tokens (reward 1)
    mask = T([[0, 1, 1, 0, 0, 1, 1]])
    rewards = T([[0, 0, 0.5, 0, 0, 0, 1.0]])
    values = T([[9, 0.1, 0.2, 9, 9, 0.3, 0.4]])  # values at masked positions must not matter
    adv, ret = token_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # by hand, backwards over the chain of action tokens (V = .1 .2 .3 .4, r = 0 .5 0 1):
    # d6 = 1 - .4 = .6                A6 = .6
    # d5 = .9*.4 - .3 = .06           A5 = .06 + .72*.6 = .492
    # d2 = .5 + .9*.3 - .2 = .57      A2 = .57 + .72*.492 = .92424
    # d1 = .9*.2 - .1 = .08           A1 = .08 + .72*.92424 = .7454528
    expected = T([[0, 0.7454528, 0.92424, 0, 0, 0.492, 0.6]])
    assert torch.allclose(adv, expected, atol=1e-6)
    assert torch.allclose(ret, T([[0, 0.8454528, 1.12424, 0, 0, 0.792, 1.0]]), atol=1e-6)
    values[0, 3] = values[0, 4] = -100.0
    assert torch.allclose(token_gae(rewards, values, mask, 0.9, 0.8)[0], expected, atol=1e-6)


def test_token_gae_lambda_one_gamma_one_is_return_minus_value():
    mask = T([[1, 1, 0, 1, 0, 0]])
    rewards = T([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0]])
    values = torch.rand(1, 6)
    adv, ret = token_gae(rewards, values, mask)
    assert torch.allclose(ret[mask.bool()], T([3.0, 3.0, 2.0]))
    assert torch.allclose(adv[mask.bool()], T([3.0, 3.0, 2.0]) - values[mask.bool()])


def test_turn_gae_and_returns_to_go():
    rewards = T([[0.0, 0.5, 1.0], [1.0, 0.0, 0.0]])
    alive = T([[1, 1, 1], [1, 0, 0]])
    values = T([[0.2, 0.4, 0.6], [0.5, 7.0, 7.0]])
    adv, ret = turn_gae(rewards, values, alive, gamma=0.5, lam=1.0)
    # episode 0: returns with gamma .5: t2 1.0; t1 .5 + .5*1 = 1.0; t0 0 + .5*1 = .5 (lam 1: A = G - V)
    assert torch.allclose(ret, T([[0.5, 1.0, 1.0], [1.0, 0, 0]]))
    assert torch.allclose(adv, T([[0.3, 0.6, 0.4], [0.5, 0, 0]]))
    assert torch.allclose(returns_to_go(rewards, alive, 0.5), T([[0.5, 1.0, 1.0], [1.0, 0, 0]]))


def episode_rewards(scores, won, max_score, density, weight=None):
    """Each turn's reward of one episode by ``step_reward`` (the rule a game's ``step`` applies)."""
    return [
        step_reward(prev, now, max_score, won and t == len(scores) - 1, t == len(scores) - 1, density, weight)
        for t, (prev, now) in enumerate(zip([0, *scores], scores))
    ]


def test_sparse_and_dense_reward_placement():
    episodes = [([1, 1, 3], True, 3), ([1, 2, 2], False, 3), ([1, 2], False, 4)]  # the third ended after 2 turns
    sparse = [episode_rewards(*e, "sparse") for e in episodes]
    assert sparse == [[0, 0, 1.0], [0, 0, 0], [0, 0]]
    with_score = [episode_rewards(*e, "sparse", 0.5) for e in episodes]
    assert with_score == [[0, 0, 1.5], [0, 0, pytest.approx(1 / 3)], [0, 0.25]]
    dense = [episode_rewards(*e, "dense") for e in episodes]
    # deltas x 0.5 / max_score, plus won on the last turn
    expected = [[1 / 6, 0, 2 / 6 + 1], [1 / 6, 1 / 6, 0], [1 / 8, 1 / 8]]
    assert all(r == pytest.approx(x) for r, x in zip(dense, expected))


def test_lost_episode_never_outscores_a_won_one():
    # lost with every milestone vs won with none: normalised by each episode's own max_score
    for density in ("sparse", "dense"):
        for weight in (0.0, 0.5, 0.99):
            lost = sum(episode_rewards([2, 5, 10], False, 10, density, weight))
            won = sum(episode_rewards([0, 0, 0], True, 3, density, weight))
            assert lost < won, (density, weight)
    with pytest.raises(ValueError, match="score_weight=1"):
        step_reward(0, 1, 3, False, True, "dense", 1.0)


def test_episode_group_baselines():
    returns = T([[1.0], [0.0], [0.5], [0.5]])
    alive = torch.ones(4, 1)
    assert torch.allclose(episode_group_advantages(returns, alive, 2, "grpo", False), T([[0.5], [-0.5], [0], [0]]))
    assert torch.allclose(episode_group_advantages(returns, alive, 2, "rloo", False), T([[1.0], [-1.0], [0], [0]]))
    normed = episode_group_advantages(returns, alive, 2, "grpo", True)
    half = 0.5**0.5  # the sample std of (1, 0) is sqrt(1/2): (+-0.5) / sqrt(1/2)
    assert torch.allclose(normed, T([[half], [-half], [0], [0]]), atol=1e-5)


def test_turn_level_group_baselines_count_every_member():
    """A finished member's return-to-go is 0 and still counts (docs/credit.md: an alive-only mean is biased)."""
    returns = T([[1.0, 0.5], [0.0, 0.0], [0.2, 0.1]])
    alive = T([[1, 1], [1, 0], [1, 1]])
    grpo = episode_group_advantages(returns, alive, 3, "grpo", False)
    assert torch.allclose(grpo, T([[0.6, 0.3], [-0.4, 0.0], [-0.2, -0.1]]))
    rloo = episode_group_advantages(returns, alive, 3, "rloo", False)
    assert torch.allclose(rloo, T([[0.9, 0.45], [-0.6, 0.0], [-0.3, -0.15]]))
    lonely = episode_group_advantages(T([[1.0, 1.0], [0.0, 0.0]]), T([[1, 1], [1, 0]]), 2, "rloo", False)
    assert lonely[0, 1] == 1.0  # alone at turn 1: the finished member's 0 is the baseline


def test_anchor_groups_form_over_equal_states_of_other_episodes():
    alive = T([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]).bool()
    anchors = torch.tensor([[0, 1, 0], [0, 1, -1], [0, 2, 3], [9, -1, -1]])  # rows 0-2: one task; row 3 alone
    sizes = anchor_groups(anchors, alive, 4)
    # turn 0: rows 0-2 share state 0 (and row 0's revisit at turn 2 counts for rows 1, 2, not for row 0)
    assert sizes[:, 0].tolist() == [2, 3, 3, 0]
    assert sizes[:, 1].tolist() == [1, 1, 0, 0]  # state 1: rows 0 and 1; state 2: row 2 alone
    assert sizes[:, 2].tolist() == [2, 0, 0, 0]  # row 0 back in state 0 meets rows 1, 2's turn 0
    # ids are compared within a task only: two tasks with the same ids do not group
    two_tasks = anchor_groups(torch.tensor([[0], [1], [0], [1]]), torch.ones(4, 1), 2)
    assert two_tasks.flatten().tolist() == [0, 0, 0, 0]


def test_step_advantages_use_other_episodes_and_fall_back_for_singletons():
    to_go = T([[1.0, 1.0], [0.0, 0.0], [0.5, 0.0]])
    alive = T([[1, 1], [1, 1], [1, 1]]).bool()
    anchors = torch.tensor([[0, 1], [0, 1], [0, 2]])
    fallback = T([[7.0, 7.0], [8.0, 8.0], [9.0, 9.0]])
    adv = step_group_advantages(to_go, alive, anchors, 3, fallback, False)
    assert torch.allclose(adv[:, 0], T([0.75, -0.75, 0.0]))  # each against the mean of the other two
    assert torch.allclose(adv[:, 1], T([1.0, -1.0, 9.0]))  # rows 0, 1 pair up; row 2 is a singleton
    normed = step_group_advantages(to_go, alive, anchors, 3, fallback, True)
    assert torch.allclose(normed[:2, 1], T([2**0.5, -(2**0.5)]), atol=1e-5)  # the pair's sample std is sqrt(1/2)


def test_step_weight_zero_is_plain_grpo_and_needs_anchors_otherwise():
    rewards = T([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    alive = torch.ones(4, 2).bool()
    plain = episode_group_advantages(returns_to_go(rewards, alive)[:, :1].expand(4, 2), alive, 2, "grpo", True)
    assert torch.allclose(episode_advantages(rewards, alive, 2, "grpo", True), plain)
    with pytest.raises(ValueError, match="anchors"):
        episode_advantages(rewards, alive, 2, "grpo", True, step_weight=1.0)
    # every step alone in its state: the step part is the episode's leave-one-out advantage
    lonely = episode_advantages(rewards, alive, 2, "rloo", False, anchors=torch.arange(8).view(4, 2), step_weight=1.0)
    assert torch.allclose(
        lonely, 2 * episode_group_advantages(T([[1.0] * 2, [0.0] * 2, [1.0] * 2, [0.0] * 2]), alive, 2, "rloo", False)
    )


def test_whitening_over_the_masked_entries():
    from lit_marl.parallel.collectives import whiten

    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = whiten(values, mask)
    chosen = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (chosen - chosen.mean()) / (chosen.std() + 1e-6)
    assert torch.allclose(out[mask.bool()], expected)
    assert (out[~mask.bool()] == 0).all()  # the padding and observation entries stay out
    assert torch.equal(whiten(values, torch.zeros_like(mask)), values)  # nothing to whiten


def test_ties_up_to_rounding_carry_no_normalized_signal():
    tied = torch.tensor([0.3, 0.3, 0.3, 0.3])
    tied[0] = torch.nextafter(tied[0], torch.tensor(1.0))  # one ulp apart: a sum taken in another order
    returns = tied.view(4, 1).expand(4, 2)
    alive = torch.ones(4, 2)
    assert episode_group_advantages(returns, alive, 4, "grpo", True).abs().max() == 0
    step = step_group_advantages(returns, alive.bool(), torch.zeros(4, 2, dtype=torch.long), 4, torch.ones(4, 2), True)
    assert step.abs().max() == 0
    assert episode_group_advantages(T([[1.0], [0.0]]), torch.ones(2, 1), 2, "grpo", True).abs().max() > 0.7


def test_turn_level_normalization_uses_the_episode_spread():
    """A lone survivor with a tiny return-to-go is not blown up to +-sqrt(G-1) by the finished members' zeros."""
    rewards = T([[0.0, 1e-4], [1.0, 0.0], [0.0, 0.0], [0.5, 0.0]])
    alive = T([[1, 1], [1, 0], [1, 0], [1, 0]]).bool()
    adv = episode_advantages(rewards, alive, 4, "grpo", True, turn_level=True)
    episode = T([1e-4, 1.0, 0.0, 0.5])
    assert torch.isclose(adv[0, 1], (1e-4 - 1e-4 / 4) / episode.std(), rtol=1e-3)
    assert adv[0, 1].abs() < 1e-3


def test_the_rounding_tie_threshold_is_each_groups_own():
    """A group's returns tie up to rounding against the size of that group's returns, not the
    batch's: a group at 1e6 beside one at 0 and 1e-3 leaves the small group's signal whole."""
    returns = T([[1e6], [2e6], [0.0], [1e-3]])
    alive = torch.ones(4, 1)
    unit = 0.5**0.5  # (r - mean) / sample std of a group of two
    expected = T([[-unit], [unit], [-unit], [unit]])
    episode = episode_group_advantages(returns, alive, 2, "grpo", True)
    torch.testing.assert_close(episode, expected)
    turn = episode_advantages(returns, alive.bool(), 2, "grpo", True, turn_level=True)
    torch.testing.assert_close(turn, expected)
    anchors = torch.zeros(4, 1, dtype=torch.long)
    step = step_group_advantages(returns, alive.bool(), anchors, 2, torch.zeros(4, 1), True)
    torch.testing.assert_close(step, expected * 2)  # r - the other's, over the pair's sample std
